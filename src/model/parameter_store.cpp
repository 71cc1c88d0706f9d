// defines: ParameterStore allocation, HF import/export and seeded initialisation.
#include "model/parameter_store.h"

#include <unistd.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "core/rng.h"
#include "io/mxfp4.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "ops/elementwise.h"
#include "ops/op_profile.h"

namespace moetrain::model {

const char* param_role_name(ParamRole role) {
  switch (role) {
    case ParamRole::Embedding: return "embedding";
    case ParamRole::Head: return "head";
    case ParamRole::Norm: return "norm";
    case ParamRole::Dense: return "dense";
    case ParamRole::Router: return "router";
    case ParamRole::ExpertBank: return "expert bank";
    case ParamRole::SharedExpert: return "shared expert";
  }
  return "?";
}

ParamSpec single_piece_spec(std::string name, Shape shape, ParamRole role, int64_t layer, std::string hf_name) {
  ParamSpec spec;
  spec.name = std::move(name);
  spec.shape = shape;
  spec.role = role;
  spec.layer = layer;
  spec.pieces.push_back({std::move(hf_name), std::move(shape), 0, {}, {}});
  spec.init = spec.is_matrix() ? ParamInit::Normal : ParamInit::Ones;
  return spec;
}

std::vector<ParamSpec> decoder_model_specs(const ModelConfig& config,
                                           const std::function<std::vector<ParamSpec>(int64_t layer)>& layer_specs,
                                           ParamInit final_norm_init) {
  std::vector<ParamSpec> specs = {single_piece_spec("embed", {config.vocab_size, config.hidden_size},
                                                    ParamRole::Embedding, -1, "model.embed_tokens.weight")};
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    for (ParamSpec& spec : layer_specs(layer)) specs.push_back(std::move(spec));
  specs.push_back(single_piece_spec("final_norm", {config.hidden_size}, ParamRole::Norm, -1, "model.norm.weight"));
  specs.back().init = final_norm_init;
  if (!config.tie_word_embeddings)
    specs.push_back(
        single_piece_spec("lm_head", {config.vocab_size, config.hidden_size}, ParamRole::Head, -1, "lm_head.weight"));
  return specs;
}

void attach_row_blocks(ParamSpec& spec, const std::vector<std::string>& hf_names) {
  const int64_t cols = spec.shape.back(), rows = shape_numel(spec.shape) / cols;
  const int64_t blocks = static_cast<int64_t>(hf_names.size());
  MT_CHECK(blocks > 0 && rows % blocks == 0, "HF adapter: '{}' ({} rows) cannot be split into {} equal row blocks",
           spec.name, rows, blocks);
  const int64_t block_rows = rows / blocks;
  for (int64_t b = 0; b < blocks; ++b)
    spec.pieces.push_back({hf_names[static_cast<size_t>(b)], {block_rows, cols}, b * block_rows * cols, {}, {}});
}

void attach_hf_mlp_pieces(ParamSpec& spec, const std::string& hf_mlp, bool experts, bool gate_up) {
  const int64_t count = experts ? spec.shape[0] : 1;
  std::vector<std::string> names;
  for (int64_t e = 0; e < count; ++e) {
    const std::string hf = experts ? fmt::format("{}experts.{}.", hf_mlp, e) : hf_mlp;
    if (gate_up) {
      names.push_back(hf + "gate_proj.weight");
      names.push_back(hf + "up_proj.weight");
    } else {
      names.push_back(hf + "down_proj.weight");
    }
  }
  attach_row_blocks(spec, names);
  if (experts) spec.hf_fused_name = hf_mlp + (gate_up ? "experts.gate_up_proj" : "experts.down_proj");
}

namespace {

// Before anything is allocated: the bytes of every master, gradient and compute copy, counted without wrapping
// (shape_nbytes refuses a shape past 2^62 bytes), must fit the host when the parameters live there. A config of
// absurd sizes fails here in milliseconds, naming the sizes, instead of allocating for a minute or wrapping a count.
void check_fits(const std::vector<ParamSpec>& specs, Device device, DType compute_dtype) {
  uint64_t total = 0;
  int64_t parameters = 0;
  const ParamSpec* largest = nullptr;
  uint64_t largest_bytes = 0;
  for (const ParamSpec& spec : specs) {
    const uint64_t master = shape_nbytes(spec.shape, DType::F32);
    const uint64_t copy = compute_dtype != DType::F32 && spec.is_matrix() ? shape_nbytes(spec.shape, compute_dtype) : 0;
    const uint64_t bytes = 2 * master + copy;  // < 2^64: each term is at most 2^62
    MT_CHECK(!__builtin_add_overflow(total, bytes, &total) && total <= kMaxTensorBytes &&
                 !__builtin_add_overflow(parameters, shape_numel(spec.shape), &parameters),
             "parameter store: the parameters need more than {} bytes (at '{}' {}): far more than any device holds",
             kMaxTensorBytes, spec.name, shape_str(spec.shape));
    if (bytes > largest_bytes) {
      largest = &spec;
      largest_bytes = bytes;
    }
  }
  if (!device.is_cpu()) return;  // the device allocator refuses what its device cannot hold, before any kernel runs
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return;
  const uint64_t host = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  MT_CHECK(total <= host,
           "parameter store: {} parameters need {} bytes of fp32 masters and gradients on the CPU, more than the {} "
           "bytes of memory this host has (the largest is '{}' {}); check the config's sizes",
           parameters, total, host, largest->name, shape_str(largest->shape));
}

}  // namespace

ParameterStore::ParameterStore(std::vector<ParamSpec> specs, Device device, DType compute_dtype)
    : specs_(std::move(specs)), compute_dtype_(compute_dtype) {
  MT_CHECK(compute_dtype == DType::F32 || (compute_dtype == DType::BF16 && device.is_cuda()),
           "parameter store: compute dtype {} on {} is not supported (f32 everywhere, bf16 on CUDA)",
           dtype_name(compute_dtype), device.str());
  check_fits(specs_, device, compute_dtype);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& spec = specs_[i];
    MT_CHECK(index_.emplace(spec.name, i).second, "parameter store: duplicate parameter '{}'", spec.name);
    check_pieces_tile(spec.pieces, spec.shape, spec.name);
    params_.push_back(Tensor::zeros(spec.shape, DType::F32, device));
    grads_.push_back(Tensor::zeros(spec.shape, DType::F32, device));
    const bool copy = compute_dtype != DType::F32 && spec.is_matrix() && !spec.f32_compute;
    compute_.push_back(copy ? Tensor::zeros(spec.shape, compute_dtype, device) : params_.back());
  }
  overwrites_first_.assign(specs_.size(), 0);
  first_write_pending_.assign(specs_.size(), 0);
}

Tensor ParameterStore::weight(const std::string& name) const {
  auto it = index_.find(name);
  MT_CHECK(it != index_.end(), "parameter store: no parameter '{}'", name);
  return compute_[it->second];
}

void ParameterStore::refresh_compute_weights() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (compute_[i].dtype() != params_[i].dtype())
      ops::cast(default_stream(params_[i].device()), compute_[i], params_[i]);
  }
}

void ParameterStore::set_compute_in_f32(const std::string& name, bool f32) {
  auto it = index_.find(name);
  MT_CHECK(it != index_.end(), "parameter store: no parameter '{}'", name);
  ParamSpec& spec = specs_[it->second];
  MT_CHECK(spec.is_matrix(), "parameter store: '{}' is not a matrix ({} dims): it has no compute copy to change", name,
           spec.shape.size());
  if (compute_dtype_ == DType::F32) return;
  spec.f32_compute = f32;
  const Tensor& master = params_[it->second];
  Tensor& compute = compute_[it->second];
  if (f32 && compute.dtype() != DType::F32) {
    compute = master;
  } else if (!f32 && compute.dtype() == DType::F32) {
    compute = Tensor::empty(spec.shape, compute_dtype_, master.device());
    ops::cast(default_stream(master.device()), compute, master);
  }
}

const ParamSpec* ParameterStore::find_role(ParamRole role) const {
  for (const ParamSpec& spec : specs_)
    if (spec.role == role && spec.layer < 0) return &spec;
  return nullptr;
}

Tensor ParameterStore::param(const std::string& name) const {
  auto it = index_.find(name);
  MT_CHECK(it != index_.end(), "parameter store: no parameter '{}'", name);
  return params_[it->second];
}

Tensor ParameterStore::grad(const std::string& name) const {
  auto it = index_.find(name);
  MT_CHECK(it != index_.end(), "parameter store: no parameter '{}'", name);
  return grads_[it->second];
}

int64_t ParameterStore::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : params_) n += p.numel();
  return n;
}

void ParameterStore::zero_grads() {
  std::fill(first_write_pending_.begin(), first_write_pending_.end(), 0);
  if (grads_.empty()) return;
  // Timed as its own op: on the workload of record it wrote 12.4 GB a step before the expert banks' gradients were
  // left to their first writes (docs/gpu_notes.md).
  const ops::OpScope profile(default_stream(grads_.front().device()), "elementwise", "zero_grads");
  for (Tensor& g : grads_) g.zero_();
}

size_t ParameterStore::overwrite_on_first_write(const std::string& name) {
  auto it = index_.find(name);
  MT_CHECK(it != index_.end(), "parameter store: no parameter '{}' to leave to its first writer", name);
  overwrites_first_[it->second] = 1;  // again for a block built twice: its writers share the one first write
  return it->second;
}

void ParameterStore::begin_accumulation() {
  first_write_pending_ = overwrites_first_;
  if (grads_.empty()) return;
  const ops::OpScope profile(default_stream(grads_.front().device()), "elementwise", "zero_grads");
  for (size_t i = 0; i < grads_.size(); ++i) {
    if (!first_write_pending_[i]) grads_[i].zero_();
  }
}

bool ParameterStore::take_first_write(size_t slot) {
  MT_CHECK(slot < grads_.size(), "parameter store: first-write slot {} of {} parameters", slot, grads_.size());
  if (!first_write_pending_[slot]) return false;
  first_write_pending_[slot] = 0;
  return true;
}

void ParameterStore::end_accumulation() {
  for (size_t i = 0; i < first_write_pending_.size(); ++i) {
    if (first_write_pending_[i]) grads_[i].zero_();
  }
  std::fill(first_write_pending_.begin(), first_write_pending_.end(), 0);
}

void ParameterStore::load_hf(const io::SafetensorsReader& reader) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : reader.names()) tensors.emplace_back(name, reader.tensor(name));  // mapped views
  load_hf_tensors(tensors);
}

namespace {

// The problems of a piece given as its MXFP4 pair (`blocks` / `scales`: null when absent), appended to `problems`.
void check_mxfp4_pair(const HfPiece& piece, const Tensor* blocks, const Tensor* scales,
                      std::vector<std::string>& problems) {
  const std::string blocks_name = io::mxfp4_blocks_name(piece.hf_name);
  const std::string scales_name = io::mxfp4_scales_name(piece.hf_name);
  const std::string packing = io::mxfp4_packing_problem(piece.hf_shape, piece.mxfp4_transposed);
  if (!packing.empty()) {
    problems.push_back(
        fmt::format("tensor '{}' (shape {}) is given as an MXFP4 pair ('{}' / '{}') but cannot be one: {}",
                    piece.hf_name, shape_str(piece.hf_shape), blocks_name, scales_name, packing));
    return;
  }
  const Shape blocks_shape = io::mxfp4_blocks_shape(piece.hf_shape, piece.mxfp4_transposed, piece.hf_name);
  const Shape scales_shape(blocks_shape.begin(), blocks_shape.end() - 1);
  const auto check = [&](const Tensor* tensor, const std::string& name, const Shape& shape, const char* part) {
    if (tensor == nullptr) {
      problems.push_back(fmt::format("missing tensor '{}' (the MXFP4 {} of '{}', expected u8 {})", name, part,
                                     piece.hf_name, shape_str(shape)));
    } else if (tensor->shape() != shape) {
      problems.push_back(fmt::format("tensor '{}' has shape {} but the config implies {} (the MXFP4 {} of '{}' {})",
                                     name, shape_str(tensor->shape()), shape_str(shape), part, piece.hf_name,
                                     shape_str(piece.hf_shape)));
    } else if (tensor->dtype() != DType::U8) {
      problems.push_back(fmt::format("tensor '{}' has dtype {} but u8 was expected (the MXFP4 {} of '{}')", name,
                                     dtype_name(tensor->dtype()), part, piece.hf_name));
    } else {
      return true;
    }
    return false;
  };
  check(blocks, blocks_name, blocks_shape, "blocks");
  const bool scales_ok = check(scales, scales_name, scales_shape, "scales");
  if (scales_ok && scales->device().is_cpu() && scales->is_contiguous()) {  // a small read: a 16th of the blocks
    const std::string nan = io::mxfp4_nan_scale_problem(*scales);
    if (!nan.empty()) problems.push_back(fmt::format("tensor '{}': {}", scales_name, nan));
  }
}

// The flat index of the first Inf or NaN of a float tensor (CPU, contiguous), or -1: read in its own encoding, no
// copy. An imported weight that is not finite would poison the first step silently.
int64_t first_non_finite(const Tensor& t) {
  const int64_t n = t.numel();
  const void* base = t.raw_data();
  const auto scan_bits = [&](auto bits_type, uint32_t exponent_mask) -> int64_t {
    using Bits = decltype(bits_type);
    const Bits* p = static_cast<const Bits*>(base);
    for (int64_t i = 0; i < n; ++i) {
      if ((static_cast<uint32_t>(p[i]) & exponent_mask) == exponent_mask) return i;
    }
    return -1;
  };
  switch (t.dtype()) {
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(static_cast<const double*>(base)[i])) return i;
      }
      return -1;
    case DType::F32: return scan_bits(uint32_t{}, 0x7f800000u);
    case DType::BF16: return scan_bits(uint16_t{}, 0x7f80u);
    case DType::F16: return scan_bits(uint16_t{}, 0x7c00u);
    case DType::F8E5M2: return scan_bits(uint8_t{}, 0x7cu);
    case DType::F8E4M3: return scan_bits(uint8_t{}, 0x7fu);  // no Inf; S.1111.111 is NaN
    default: return -1;
  }
}

}  // namespace

void ParameterStore::load_hf_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::map<std::string, Tensor> by_name;
  std::vector<std::string> problems;
  for (const auto& [name, tensor] : tensors) {
    if (!by_name.emplace(name, tensor).second) problems.push_back(fmt::format("tensor '{}' given twice", name));
  }
  const auto find = [&](const std::string& name) -> const Tensor* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &it->second;
  };
  std::set<std::string> expected;
  for (const ParamSpec& spec : specs_) {
    for (const HfPiece& piece : spec.pieces) {
      expected.insert(piece.hf_name);
      const Tensor* whole = find(piece.hf_name);
      // A piece may come as its MXFP4 pair instead (io/mxfp4.h), decoded when it is placed.
      const std::string blocks_name = io::mxfp4_blocks_name(piece.hf_name);
      const std::string scales_name = io::mxfp4_scales_name(piece.hf_name);
      const Tensor* blocks = find(blocks_name);
      const Tensor* scales = find(scales_name);
      if (blocks != nullptr || scales != nullptr) {
        expected.insert(blocks_name);
        expected.insert(scales_name);
      }
      if (whole != nullptr && (blocks != nullptr || scales != nullptr)) {
        problems.push_back(fmt::format("tensor '{}' is given both whole and as MXFP4 ('{}'): keep one of them",
                                       piece.hf_name, blocks != nullptr ? blocks_name : scales_name));
      } else if (whole == nullptr && (blocks != nullptr || scales != nullptr)) {
        check_mxfp4_pair(piece, blocks, scales, problems);
      } else if (whole == nullptr) {
        problems.push_back(
            fmt::format("missing tensor '{}' (expected shape {})", piece.hf_name, shape_str(piece.hf_shape)));
      } else if (whole->shape() != piece.hf_shape) {
        problems.push_back(fmt::format("tensor '{}' has shape {} but the config implies {}", piece.hf_name,
                                       shape_str(whole->shape()), shape_str(piece.hf_shape)));
      } else if (!dtype_is_floating(whole->dtype())) {
        problems.push_back(fmt::format("tensor '{}' has dtype {} but a float dtype was expected", piece.hf_name,
                                       dtype_name(whole->dtype())));
      } else if (whole->device().is_cpu() && whole->is_contiguous()) {
        const int64_t bad = first_non_finite(*whole);
        if (bad >= 0) {
          problems.push_back(fmt::format("tensor '{}' holds a non-finite value ({}) at flat index {}", piece.hf_name,
                                         whole->view({-1}).slice(bad, bad + 1).to(DType::F64).item<double>(), bad));
        }
      }
    }
  }
  for (const auto& [name, tensor] : by_name) {
    if (!expected.count(name)) problems.push_back(fmt::format("unexpected tensor '{}'", name));
  }
  MT_CHECK(problems.empty(), "model weights: {} problem(s) with the checkpoint:\n  {}", problems.size(),
           fmt::join(problems, "\n  "));
  for (size_t i = 0; i < specs_.size(); ++i) {
    // Assembled on the host one parameter at a time, then copied whole; an MXFP4 piece is decoded into f32 when it
    // is placed and freed after (one piece's f32 at a time, as a bf16 piece's conversion takes).
    Tensor whole = Tensor::empty(specs_[i].shape, DType::F32);
    for (const HfPiece& piece : specs_[i].pieces) {
      if (const Tensor* value = find(piece.hf_name)) {
        place_piece(whole, piece, *value);
        continue;
      }
      const Tensor& blocks = by_name.at(io::mxfp4_blocks_name(piece.hf_name));
      const Tensor& scales = by_name.at(io::mxfp4_scales_name(piece.hf_name));
      place_piece(whole, piece,
                  piece.mxfp4_transposed ? io::dequantize_mxfp4_transposed(blocks, scales)
                                         : io::dequantize_mxfp4(blocks, scales));
    }
    params_[i].copy_from(whole);
  }
  refresh_compute_weights();
}

std::vector<std::pair<std::string, Tensor>> ParameterStore::export_hf(bool of_grads) const {
  return export_hf_runtime(of_grads, [](const std::string&) { return false; });
}

std::vector<std::pair<std::string, Tensor>> ParameterStore::export_hf_runtime(
    bool of_grads, const std::function<bool(const std::string&)>& use_fused) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Tensor& whole = of_grads ? grads_[i] : params_[i];
    const Tensor host = whole.device().is_cpu() ? whole : whole.to(Device::cpu());  // contiguous f32
    if (!specs_[i].hf_fused_name.empty() && use_fused(specs_[i].hf_fused_name)) {
      out.emplace_back(specs_[i].hf_fused_name, host.clone());
      continue;
    }
    for (const HfPiece& piece : specs_[i].pieces) out.emplace_back(piece.hf_name, extract_piece(host, piece));
  }
  return out;
}

void ParameterStore::init_random(uint64_t seed, double std) {
  for (size_t i = 0; i < specs_.size(); ++i) {
    Tensor host = Tensor::empty(specs_[i].shape, DType::F32);
    float* p = host.data<float>();
    const int64_t n = host.numel();
    if (specs_[i].init == ParamInit::LogUniform) {
      Rng rng = Rng::for_key(seed, specs_[i].name);  // a vector (one value per head): one sequential stream
      for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(std::log(0.01 + (16.0 - 0.01) * rng.uniform()));
    } else if (specs_[i].init != ParamInit::Normal) {
      const float value = specs_[i].init == ParamInit::Ones ? 1.0f : 0.0f;
      for (int64_t j = 0; j < n; ++j) p[j] = value;
    } else {
      // normal() takes exactly two draws, so element j is the stream started at counter + 2j: chunks
      // fill in parallel with the same values as one sequential pass. Every core helps, whatever
      // OMP_NUM_THREADS says (torchrun sets 1): billions of draws otherwise take minutes.
      const Rng base = Rng::for_key(seed, specs_[i].name);
      constexpr int64_t kChunk = 1 << 16;
#pragma omp parallel for schedule(static) num_threads(omp_get_num_procs())
      for (int64_t start = 0; start < n; start += kChunk) {
        Rng rng(base.seed(), base.counter() + 2 * static_cast<uint64_t>(start));
        const int64_t end = std::min(n, start + kChunk);
        for (int64_t j = start; j < end; ++j) p[j] = static_cast<float>(rng.normal() * std);
      }
    }
    params_[i].copy_from(host);
  }
  refresh_compute_weights();
}

}  // namespace moetrain::model
