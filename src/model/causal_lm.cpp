// defines: the whole-model prolog and epilog, and the model's construction from its family.
#include "model/causal_lm.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"
#include "io/safetensors.h"
#include "model/family.h"
#include "model/precision.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/linear_cross_entropy.h"
#include "ops/loss.h"

namespace moetrain::model {

namespace {

const Family& family_of(const ModelConfig& config) {
  MT_CHECK(config.family != nullptr, "model: the config of '{}' names no family (parse it with parse_model_config)",
           config.model_type);
  return *config.family;
}

}  // namespace

CausalLm::CausalLm(const ModelConfig& config, Device device, DType compute_dtype)
    : config_(config),
      device_(device),
      params_(std::make_unique<ParameterStore>(family_of(config).param_specs(config), device, compute_dtype)),
      stream_dtype_(compute_dtype) {
  final_norm_ = config.family->final_norm(config);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    layers_.push_back(config.family->make_layer(config_, *params_, layer));
  MT_CHECK(params_->find_role(ParamRole::Embedding) != nullptr && params_->find_role(ParamRole::Norm) != nullptr,
           "model: family '{}' declared no embedding or no final norm (a Norm outside the decoder layers)",
           config.family->name());
  if (const ParamSpec* head = params_->find_role(ParamRole::Head)) head_writer_ = GradientWriter(*params_, head->name);
}

Tensor CausalLm::head_weight() const {
  const ParamSpec* head = params_->find_role(ParamRole::Head);
  return params_->weight(head ? head->name : params_->find_role(ParamRole::Embedding)->name);
}

Tensor CausalLm::head_grad() const {
  const ParamSpec* head = params_->find_role(ParamRole::Head);
  return params_->grad(head ? head->name : params_->find_role(ParamRole::Embedding)->name);
}

Tensor CausalLm::final_norm_weight() const { return params_->weight(params_->find_role(ParamRole::Norm)->name); }

Tensor CausalLm::final_norm_grad() const { return params_->grad(params_->find_role(ParamRole::Norm)->name); }

void CausalLm::set_head_chunk(int64_t columns) {
  MT_CHECK(columns >= 0, "model: the head chunk must be >= 0 columns (0: materialised logits) but is {}", columns);
  head_chunk_ = columns;
}

std::unique_ptr<CausalLm> CausalLm::from_hf(const std::string& dir, Device device, DType compute_dtype) {
  const ModelConfig config = load_model_config(dir);
  auto model = std::make_unique<CausalLm>(config, device, compute_dtype);
  model->load_hf_weights(io::SafetensorsReader::open(dir));
  return model;
}

void CausalLm::load_hf_weights(const io::SafetensorsReader& reader) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, int64_t> left_out;  // by the name's first two components ("model.visual")
  for (const std::string& name : reader.names()) {
    const std::string read_as = config_.family->checkpoint_tensor_name(name);
    if (!read_as.empty()) {
      tensors.emplace_back(read_as, reader.tensor(name));  // mapped views
      continue;
    }
    const size_t first = name.find('.');
    const size_t second = first == std::string::npos ? first : name.find('.', first + 1);
    ++left_out[name.substr(0, second) + ".*"];
  }
  if (!left_out.empty()) {
    std::vector<std::string> parts;
    int64_t count = 0;
    for (const auto& [prefix, n] : left_out) {
      parts.push_back(fmt::format("{} {}", n, prefix));
      count += n;
    }
    log_info("checkpoint: left out {} tensor(s) that the {} model does not use ({})", count, config_.model_type,
             fmt::join(parts, ", "));
  }
  params_->load_hf_tensors(tensors);
}

void CausalLm::set_stream_dtype(DType dtype) {
  MT_CHECK(dtype == compute_dtype() || dtype == DType::F32,
           "model: the residual stream must be in the compute dtype ({}) or in f32, not {}",
           dtype_name(compute_dtype()), dtype_name(dtype));
  stream_dtype_ = dtype;
  // autocast's embedding reads the fp32 weight, so an f32 stream starts from the master table's rows, not from
  // their bf16 copies; a table the head shares keeps its copy, which the head's GEMM reads.
  const bool tied = params_->find_role(ParamRole::Head) == nullptr;
  if (!tied) params_->set_compute_in_f32(params_->find_role(ParamRole::Embedding)->name, dtype == DType::F32);
}

void CausalLm::set_recompute_activation(bool on) {
  for (const std::unique_ptr<DecoderLayer>& layer : layers_) layer->set_recompute_activation(on);
  recompute_activation_ = on;
}

CausalLm::~CausalLm() {
  if (exact_) default_stream(device_).release_batch_invariant();
}

void CausalLm::set_exact(bool exact) {
  if (exact == exact_) return;
  exact_ = exact;
  Stream& stream = default_stream(device_);
  exact ? stream.hold_batch_invariant() : stream.release_batch_invariant();
}

void CausalLm::round_boundary(Tensor& hidden) const {
  if (exact_ && hidden.dtype() == DType::F32) ops::round_to_bf16_inplace(default_stream(hidden.device()), hidden);
}

Tensor token_logprobs_from_losses(const Tensor& losses, const Tensor& targets) {
  expect_dtype(losses, DType::F32, "token log-probs: per-token losses");
  expect_dtype(targets, DType::I32, "token log-probs: targets");
  MT_CHECK(losses.dim() == 1 && targets.shape() == losses.shape(),
           "token log-probs: expected losses [T] and targets [T] but found {} and {}", losses.describe(),
           targets.describe());
  const std::vector<float> loss = losses.to_vector<float>();
  const std::vector<int32_t> target = targets.to_vector<int32_t>();
  std::vector<float> logprob(loss.size());
  // 0.0f - x is +0.0f for x = +-0.0f, so a zero loss never gives -0.0f.
  for (size_t t = 0; t < loss.size(); ++t) logprob[t] = target[t] == ops::kIgnoreIndex ? 0.0f : 0.0f - loss[t];
  return Tensor::from_vector(logprob, losses.shape());
}

Tensor CausalLm::embed_forward(const MicroBatch& batch) const {
  Tensor hidden = Tensor::empty({batch.num_tokens(), config_.hidden_size}, stream_dtype_, device_);
  ops::embedding_forward(default_stream(device_), hidden, batch.input_ids,
                         params_->weight(params_->find_role(ParamRole::Embedding)->name));
  return hidden;
}

void CausalLm::embed_backward(const MicroBatch& batch, const Tensor& d_hidden) const {
  ops::embedding_backward_weight(default_stream(device_), params_->grad(params_->find_role(ParamRole::Embedding)->name),
                                 d_hidden, batch.input_ids);
}

LossSum LossSum::pending_on_device(Tensor totals) {
  MT_CHECK(totals.defined() && totals.dtype() == DType::F64 && totals.numel() == 2,
           "LossSum: expected pending totals as f64 [2] {{sum, count}} but found {}",
           totals.defined() ? totals.describe() : std::string("none"));
  LossSum sum;
  sum.pending_ = std::move(totals);
  return sum;
}

double LossSum::ce_sum() const {
  MT_CHECK(resolved(), "LossSum: the cross-entropy sum is still on {}; expected resolve_losses before reading it",
           pending_.device().str());
  return ce_sum_;
}

int64_t LossSum::num_targets() const {
  MT_CHECK(resolved(), "LossSum: the target count is still on {}; expected resolve_losses before reading it",
           pending_.device().str());
  return num_targets_;
}

void LossSum::read(Stream& stream, const std::vector<LossSum*>& losses) {
  std::vector<Tensor> pending;
  for (const LossSum* l : losses) {
    MT_CHECK(!l->resolved(), "LossSum::read: expected pending sums but found one already read");
    pending.push_back(l->pending_);
  }
  const std::vector<ops::LossTotals> totals = ops::read_loss_totals(stream, pending);
  for (size_t i = 0; i < losses.size(); ++i) {
    losses[i]->ce_sum_ = totals[i].sum;
    losses[i]->num_targets_ = totals[i].count;
    losses[i]->pending_ = Tensor();
  }
}

void resolve_losses(std::vector<LossSum>& losses) {
  std::vector<LossSum*> pending;
  for (LossSum& l : losses)
    if (!l.resolved()) pending.push_back(&l);
  if (pending.empty()) return;
  const Device device = pending.front()->pending_device();
  for (const LossSum* l : pending)
    MT_CHECK(l->pending_device() == device, "resolve_losses: pending sums on {} and {}; expected one device",
             device.str(), l->pending_device().str());
  LossSum::read(default_stream(device), pending);
}

namespace {

// The epilog's first step, shared by both heads: the record's inputs, the final norm, and room for the losses.
// The norm reads the stream in its dtype and writes the compute dtype, which the head reads.
void start_epilog(EpilogRecord& r, const Tensor& hidden, const MicroBatch& batch, const Tensor& norm_weight,
                  const ops::RmsNormParams& norm, DType compute, Device device) {
  const int64_t T = hidden.size(0);
  const Tensor input = hidden;  // `hidden` may be a field of `r`
  r = EpilogRecord{};
  r.hidden = input;
  r.batch = &batch;
  r.rstd = Tensor::empty({T}, statistics_dtype(compute), device);
  r.normed = Tensor::empty(hidden.shape(), compute, device);
  ops::rmsnorm_forward(default_stream(device), r.normed, r.rstd, hidden, norm_weight, norm);
  r.losses = Tensor::empty({T}, statistics_dtype(compute), device);
  r.lse = Tensor::empty({T}, statistics_dtype(compute), device);
}

}  // namespace

LossSum CausalLm::head_forward(EpilogRecord& r, const Tensor& hidden, const MicroBatch& batch, double loss_scale,
                               bool keep_logits) const {
  MT_CHECK(std::isfinite(loss_scale) && loss_scale >= 0.0,
           "head_forward: expected a finite loss scale >= 0 (0: forward only) but found {}", loss_scale);
  Stream& s = default_stream(device_);
  start_epilog(r, hidden, batch, final_norm_weight(), final_norm_, compute_dtype(), device_);
  if (!head_is_fused(keep_logits)) {
    r.logits = Tensor::empty({hidden.size(0), config_.vocab_size}, compute_dtype(), device_);
    ops::linear_forward(s, r.logits, r.normed, head_weight());
    if (loss_scale > 0.0 && !keep_logits) {
      // A training step whose logits nobody reads: their gradient replaces them now, in the pass that reads them for
      // the loss (the same bits as the backward's own pass).
      ops::cross_entropy_forward_backward(s, r.losses, r.lse, r.logits, r.logits, batch.targets, loss_scale);
      r.logits_hold_gradient = true;
      r.loss_scale = loss_scale;
    } else {
      ops::cross_entropy_forward(s, r.losses, r.lse, r.logits, batch.targets);
    }
  } else if (loss_scale > 0.0) {
    r.d_normed = Tensor::empty(r.normed.shape(), r.normed.dtype(), device_);
    if (head_writer_.next() == ops::GradientWrite::Overwrite) head_grad().zero_();  // it adds chunk by chunk
    ops::linear_cross_entropy_forward_backward(s, r.losses, r.lse, r.d_normed, head_grad(), r.normed, head_weight(),
                                               batch.targets, loss_scale, head_chunk_);
    r.fused = true;
    r.loss_scale = loss_scale;
  } else {
    ops::linear_cross_entropy_forward(s, r.losses, r.lse, r.normed, head_weight(), batch.targets, head_chunk_);
  }
  LossSum sum = LossSum::pending_on_device(ops::cross_entropy_totals_pending(s, r.losses, batch.targets));
  if (device_.is_cpu()) LossSum::read(s, {&sum});
  return sum;
}

Tensor CausalLm::head_backward_input(EpilogRecord& r, double loss_scale) const {
  Stream& s = default_stream(device_);
  if (r.fused || r.logits_hold_gradient) {
    MT_CHECK(loss_scale == r.loss_scale,
             "head_backward_input: the {} head's forward produced gradients for loss scale {} but the backward asks "
             "for {}",
             r.fused ? "fused" : "materialised", r.loss_scale, loss_scale);
  }
  if (!r.fused) {
    MT_CHECK(r.logits.defined(),
             "head_backward_input: the epilog record holds no logits (a forward-only fused head, loss scale 0, cannot "
             "be back-propagated)");
    // In place: the logits' gradient replaces them in their buffer (they are not needed again), so the [T, V] logits
    // never exist twice; r.logits then holds the gradient, which the weight pass reads.
    if (!r.logits_hold_gradient)
      ops::cross_entropy_backward(s, r.logits, r.logits, r.lse, r.batch->targets, loss_scale);
    r.d_normed = Tensor::empty(r.normed.shape(), r.normed.dtype(), device_);
    ops::linear_backward_input(s, r.d_normed, r.logits, head_weight());
  }
  // The final norm's input and weight gradients in one pass where the backend can (its output gradient is then not
  // held for the weight pass).
  Tensor d_hidden = Tensor::empty(r.hidden.shape(), r.hidden.dtype(), device_);
  ops::rmsnorm_backward(s, d_hidden, final_norm_grad(), r.d_normed, r.hidden, final_norm_weight(), r.rstd,
                        final_norm_);
  r.d_normed = Tensor();
  return d_hidden;
}

void CausalLm::head_backward_weight(EpilogRecord& r) const {
  Stream& s = default_stream(device_);
  // A fused forward accumulated the head's weight gradient already; r.logits then holds nothing.
  if (!r.fused) ops::linear_backward_weight(s, head_grad(), r.logits, r.normed, head_writer_.next());
  r = EpilogRecord{};
}

}  // namespace moetrain::model
