// defines: ParameterStore allocation, HF import/export and seeded initialisation.
#include "model/parameter_store.h"

#include <omp.h>

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "core/rng.h"
#include "io/safetensors.h"
#include "ops/elementwise.h"

namespace moetrain::model {

namespace {

void check_pieces_tile(const ParamSpec& spec) {
  int64_t expected_offset = 0;
  for (const HfPiece& piece : spec.pieces) {
    MT_CHECK(piece.offset == expected_offset,
             "parameter store: piece '{}' of '{}' starts at element {} but {} was expected", piece.hf_name, spec.name,
             piece.offset, expected_offset);
    expected_offset += shape_numel(piece.hf_shape);
  }
  MT_CHECK(expected_offset == shape_numel(spec.shape),
           "parameter store: pieces of '{}' cover {} elements but it has {}", spec.name, expected_offset,
           shape_numel(spec.shape));
}

Tensor piece_view(const Tensor& whole, const HfPiece& piece) {
  const int64_t n = shape_numel(piece.hf_shape);
  return whole.view({-1}).slice(piece.offset, piece.offset + n).view(piece.hf_shape);
}

}  // namespace

ParameterStore::ParameterStore(std::vector<ParamSpec> specs, Device device, DType compute_dtype)
    : specs_(std::move(specs)), compute_dtype_(compute_dtype) {
  MT_CHECK(compute_dtype == DType::F32 || (compute_dtype == DType::BF16 && device.is_cuda()),
           "parameter store: compute dtype {} on {} is not supported (f32 everywhere, bf16 on CUDA)",
           dtype_name(compute_dtype), device.str());
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& spec = specs_[i];
    MT_CHECK(index_.emplace(spec.name, i).second, "parameter store: duplicate parameter '{}'", spec.name);
    check_pieces_tile(spec);
    params_.push_back(Tensor::zeros(spec.shape, DType::F32, device));
    grads_.push_back(Tensor::zeros(spec.shape, DType::F32, device));
    const bool copy = compute_dtype != DType::F32 && spec.is_matrix();
    compute_.push_back(copy ? Tensor::zeros(spec.shape, compute_dtype, device) : params_.back());
  }
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
  for (Tensor& g : grads_) g.zero_();
}

void ParameterStore::load_hf(const io::SafetensorsReader& reader) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : reader.names()) tensors.emplace_back(name, reader.tensor(name));  // mapped views
  load_hf_tensors(tensors);
}

void ParameterStore::load_hf_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::map<std::string, Tensor> by_name;
  std::vector<std::string> problems;
  for (const auto& [name, tensor] : tensors) {
    if (!by_name.emplace(name, tensor).second) problems.push_back(fmt::format("tensor '{}' given twice", name));
  }
  std::set<std::string> expected;
  for (const ParamSpec& spec : specs_) {
    for (const HfPiece& piece : spec.pieces) {
      expected.insert(piece.hf_name);
      auto it = by_name.find(piece.hf_name);
      if (it == by_name.end()) {
        problems.push_back(
            fmt::format("missing tensor '{}' (expected shape {})", piece.hf_name, shape_str(piece.hf_shape)));
      } else if (it->second.shape() != piece.hf_shape) {
        problems.push_back(fmt::format("tensor '{}' has shape {} but the config implies {}", piece.hf_name,
                                       shape_str(it->second.shape()), shape_str(piece.hf_shape)));
      } else if (!dtype_is_floating(it->second.dtype())) {
        problems.push_back(fmt::format("tensor '{}' has dtype {} but a float dtype was expected", piece.hf_name,
                                       dtype_name(it->second.dtype())));
      }
    }
  }
  for (const auto& [name, tensor] : by_name) {
    if (!expected.count(name)) problems.push_back(fmt::format("unexpected tensor '{}'", name));
  }
  MT_CHECK(problems.empty(), "model weights: {} problem(s) with the checkpoint:\n  {}", problems.size(),
           fmt::join(problems, "\n  "));
  for (size_t i = 0; i < specs_.size(); ++i) {
    for (const HfPiece& piece : specs_[i].pieces) {
      Tensor source = by_name.at(piece.hf_name);
      if (source.dtype() != DType::F32) source = source.to(DType::F32);
      piece_view(params_[i], piece).copy_from(source);
    }
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
    const Tensor host = whole.device().is_cpu() ? whole : whole.to(Device::cpu());
    if (!specs_[i].hf_fused_name.empty() && use_fused(specs_[i].hf_fused_name)) {
      out.emplace_back(specs_[i].hf_fused_name, host.clone());
      continue;
    }
    for (const HfPiece& piece : specs_[i].pieces) out.emplace_back(piece.hf_name, piece_view(host, piece).clone());
  }
  return out;
}

void ParameterStore::init_random(uint64_t seed, double std) {
  for (size_t i = 0; i < specs_.size(); ++i) {
    Tensor host = Tensor::empty(specs_[i].shape, DType::F32);
    float* p = host.data<float>();
    const int64_t n = host.numel();
    if (!specs_[i].is_matrix()) {
      for (int64_t j = 0; j < n; ++j) p[j] = 1.0f;
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
