// defines: the whole-model prolog, epilog and the single-rank forward/backward driver.
#include "model/causal_lm.h"

#include <algorithm>
#include <cmath>

#include "io/safetensors.h"
#include "model/precision.h"
#include "model/qwen3.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/linear_cross_entropy.h"
#include "ops/loss.h"

namespace moetrain::model {

namespace {

std::vector<ParamSpec> param_specs_for(const io::ModelConfig& config) {
  switch (config.family) {
    case io::ModelFamily::Qwen3:
    case io::ModelFamily::Qwen3Moe: return qwen3_param_specs(config);
  }
  MT_FAIL("model: no parameter layout for model_type '{}'", config.model_type);
}

std::unique_ptr<DecoderLayer> make_layer(const io::ModelConfig& config, ParameterStore& store, int64_t layer) {
  switch (config.family) {
    case io::ModelFamily::Qwen3:
    case io::ModelFamily::Qwen3Moe: return std::make_unique<Qwen3DecoderLayer>(config, store, layer);
  }
  MT_FAIL("model: no decoder layer for model_type '{}'", config.model_type);
}

const char* head_name(const ParameterStore& store) { return store.contains("lm_head") ? "lm_head" : "embed"; }

void add_to_step(StepLoss& step, const RouterLossValues& values) {
  step.load_balance += values.load_balance * static_cast<double>(values.tokens);
  step.z_loss += values.z_loss * static_cast<double>(values.tokens);
}

// Sums the auxiliary router losses of one micro-batch's layers into the step totals; values left on
// the device are only collected here (reading them now would wait for the stream).
void add_router_losses(StepLoss& step, const Stage1Record& record) {
  if (!record.aux.on_device.defined()) {
    add_to_step(step, record.aux);
    return;
  }
  step.pending_router_losses.push_back(record.aux);
}

void finish_router_losses(StepLoss& step, const CausalLm& model) {
  std::vector<RouterLossValues> values = std::move(step.pending_router_losses);
  step.pending_router_losses.clear();
  if (!values.empty()) {
    // One wait for the step: gather the device pairs (stream-ordered copies), then one copy to the host.
    const Device device = values.front().on_device.device();
    const bool one_device = std::all_of(values.begin(), values.end(),
                                        [&](const RouterLossValues& v) { return v.on_device.device() == device; });
    if (one_device) {
      Tensor gathered = Tensor::empty({static_cast<int64_t>(values.size()), 2}, DType::F32, device);
      for (size_t i = 0; i < values.size(); ++i)
        gathered.select(static_cast<int64_t>(i)).copy_from(values[i].on_device);
      const std::vector<float> host = gathered.to(Device::cpu()).to_vector<float>();
      for (size_t i = 0; i < values.size(); ++i) {
        values[i].load_balance = host[2 * i];
        values[i].z_loss = host[2 * i + 1];
        values[i].on_device = Tensor();
      }
    }
    for (RouterLossValues& v : values) {
      v.resolve();  // a no-op once gathered above
      add_to_step(step, v);
    }
  }
  int64_t moe_layers = 0;
  for (const auto& layer : model.layers()) moe_layers += layer->has_experts() ? 1 : 0;
  const double weight = static_cast<double>(step.num_tokens) * static_cast<double>(std::max<int64_t>(moe_layers, 1));
  step.load_balance /= weight;
  step.z_loss /= weight;
}

int64_t count_targets(const std::vector<MicroBatch>& batches) {
  int64_t n = 0;
  for (const MicroBatch& mb : batches) n += mb.num_targets();
  return n;
}

}  // namespace

CausalLm::CausalLm(const io::ModelConfig& config, Device device, DType compute_dtype)
    : config_(config),
      device_(device),
      params_(std::make_unique<ParameterStore>(param_specs_for(config), device, compute_dtype)) {
  final_norm_.eps = static_cast<float>(config.rms_norm_eps);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    layers_.push_back(make_layer(config_, *params_, layer));
}

std::unique_ptr<CausalLm> CausalLm::from_hf(const std::string& dir, Device device, DType compute_dtype) {
  const io::ModelConfig config = io::load_model_config(dir);
  auto model = std::make_unique<CausalLm>(config, device, compute_dtype);
  model->params().load_hf(io::SafetensorsReader::open(dir));
  return model;
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
  Tensor hidden = Tensor::empty({batch.num_tokens(), config_.hidden_size}, params_->compute_dtype(), device_);
  ops::embedding_forward(default_stream(device_), hidden, batch.input_ids, params_->weight("embed"));
  return hidden;
}

void CausalLm::embed_backward(const MicroBatch& batch, const Tensor& d_hidden) const {
  ops::embedding_backward_weight(default_stream(device_), params_->grad("embed"), d_hidden, batch.input_ids);
}

namespace {

// The epilog's first step, shared by both heads: the record's inputs, the final norm, and room for the losses.
void start_epilog(EpilogRecord& r, const Tensor& hidden, const MicroBatch& batch, const Tensor& norm_weight,
                  const ops::RmsNormParams& norm, Device device) {
  const int64_t T = hidden.size(0);
  const Tensor input = hidden;  // `hidden` may be a field of `r`
  r = EpilogRecord{};
  r.hidden = input;
  r.batch = &batch;
  r.rstd = Tensor::empty({T}, statistics_dtype(hidden.dtype()), device);
  r.normed = Tensor::empty(hidden.shape(), hidden.dtype(), device);
  ops::rmsnorm_forward(default_stream(device), r.normed, r.rstd, hidden, norm_weight, norm);
  r.losses = Tensor::empty({T}, statistics_dtype(hidden.dtype()), device);
  r.lse = Tensor::empty({T}, statistics_dtype(hidden.dtype()), device);
}

}  // namespace

LossSum CausalLm::head_forward(EpilogRecord& r, const Tensor& hidden, const MicroBatch& batch) const {
  Stream& s = default_stream(device_);
  start_epilog(r, hidden, batch, params_->weight("final_norm"), final_norm_, device_);
  r.logits = Tensor::empty({hidden.size(0), config_.vocab_size}, hidden.dtype(), device_);
  ops::linear_forward(s, r.logits, r.normed, params_->weight(head_name(*params_)));
  ops::cross_entropy_forward(s, r.losses, r.lse, r.logits, batch.targets);
  const ops::LossTotals totals = ops::cross_entropy_totals(s, r.losses, batch.targets);
  return {totals.sum, totals.count};
}

LossSum CausalLm::head_forward_fused(EpilogRecord& r, const Tensor& hidden, const MicroBatch& batch,
                                     double loss_scale) const {
  MT_CHECK(std::isfinite(loss_scale) && loss_scale >= 0.0,
           "head_forward_fused: expected a finite loss scale >= 0 (0: forward only) but found {}", loss_scale);
  MT_CHECK(head_chunk_ > 0, "head_forward_fused: expected a head chunk > 0 columns but found {}", head_chunk_);
  Stream& s = default_stream(device_);
  start_epilog(r, hidden, batch, params_->weight("final_norm"), final_norm_, device_);
  const char* head = head_name(*params_);
  if (loss_scale > 0.0) {
    r.d_normed = Tensor::empty(r.normed.shape(), r.normed.dtype(), device_);
    ops::linear_cross_entropy_forward_backward(s, r.losses, r.lse, r.d_normed, params_->grad(head), r.normed,
                                               params_->weight(head), batch.targets, loss_scale, head_chunk_);
    r.fused = true;
    r.loss_scale = loss_scale;
  } else {
    ops::linear_cross_entropy_forward(s, r.losses, r.lse, r.normed, params_->weight(head), batch.targets, head_chunk_);
  }
  const ops::LossTotals totals = ops::cross_entropy_totals(s, r.losses, batch.targets);
  return {totals.sum, totals.count};
}

Tensor CausalLm::head_backward_input(EpilogRecord& r, double loss_scale) const {
  Stream& s = default_stream(device_);
  if (r.fused) {
    MT_CHECK(loss_scale == r.loss_scale,
             "head_backward_input: the fused head's forward produced gradients for loss scale {} but the backward "
             "asks for {}",
             r.loss_scale, loss_scale);
  } else {
    MT_CHECK(r.logits.defined(),
             "head_backward_input: the epilog record holds no logits (a forward-only head_forward_fused with loss "
             "scale 0 cannot be back-propagated)");
    Tensor d_logits = Tensor::empty(r.logits.shape(), r.logits.dtype(), device_);
    ops::cross_entropy_backward(s, d_logits, r.logits, r.lse, r.batch->targets, loss_scale);
    r.logits = d_logits;  // the logits are no longer needed; keep their gradient for the weight pass
    r.d_normed = Tensor::empty(r.normed.shape(), r.normed.dtype(), device_);
    ops::linear_backward_input(s, r.d_normed, d_logits, params_->weight(head_name(*params_)));
  }
  Tensor d_hidden = Tensor::empty(r.hidden.shape(), r.hidden.dtype(), device_);
  ops::rmsnorm_backward_input(s, d_hidden, r.d_normed, r.hidden, params_->weight("final_norm"), r.rstd, final_norm_);
  return d_hidden;
}

void CausalLm::head_backward_weight(EpilogRecord& r) const {
  Stream& s = default_stream(device_);
  // A fused forward accumulated the head's weight gradient already; r.logits then holds nothing.
  if (!r.fused) ops::linear_backward_weight(s, params_->grad(head_name(*params_)), r.logits, r.normed);
  ops::rmsnorm_backward_weight(s, params_->grad("final_norm"), r.d_normed, r.hidden, r.rstd);
  r = EpilogRecord{};
}

namespace {

// Forward of one micro-batch (on the model's device) through the embedding, the layers and the
// head, adding its loss and router losses to `step`. With `records` sized to the layers, every
// layer's record is kept for the backward; when empty, each record is dropped once its layer ran.
// The head is the fused one (head_forward_fused with `loss_scale`: > 0 produces the head's gradients
// now, 0 is forward only) unless the caller observes the logits or the model's head chunk is 0.
void forward_micro_batch(const CausalLm& model, const MicroBatch& batch, std::vector<LayerRecord>& records,
                         EpilogRecord& epilog, StepLoss& step, ForwardObservation* observe, double loss_scale) {
  Tensor hidden = model.embed_forward(batch);
  model.round_boundary(hidden);
  std::vector<Tensor> router_logits;
  for (size_t i = 0; i < model.layers().size(); ++i) {
    LayerRecord scratch;
    LayerRecord& record = records.empty() ? scratch : records[i];
    hidden = model.layers()[i]->reference_forward(record, hidden, batch);
    model.round_boundary(hidden);
    if (record.stage1_out.routing.defined()) router_logits.push_back(record.stage1_out.routing.logits);
    add_router_losses(step, record.stage1);
  }
  step.num_tokens += batch.num_tokens();
  const bool materialise_logits = observe != nullptr || model.head_chunk() == 0;
  const LossSum sum = materialise_logits ? model.head_forward(epilog, hidden, batch)
                                         : model.head_forward_fused(epilog, hidden, batch, loss_scale);
  step.ce_sum += sum.ce_sum;
  step.num_targets += sum.num_targets;
  if (observe) {
    observe->logits.push_back(epilog.logits);
    observe->router_logits.push_back(std::move(router_logits));
    observe->token_logprobs.push_back(token_logprobs_from_losses(epilog.losses, batch.targets));
  }
}

}  // namespace

StepLoss forward_backward(const CausalLm& model, const std::vector<MicroBatch>& batches, int64_t global_num_targets,
                          ForwardObservation* observe) {
  const int64_t local_targets = count_targets(batches);
  const int64_t denominator = global_num_targets > 0 ? global_num_targets : local_targets;
  MT_CHECK(denominator > 0, "forward_backward: the step has no counted targets (every target is -100)");
  const double loss_scale = 1.0 / static_cast<double>(denominator);
  StepLoss step;
  for (const MicroBatch& host_batch : batches) {
    host_batch.validate(model.config().vocab_size);
    const MicroBatch batch = host_batch.to(model.device());
    std::vector<LayerRecord> records(model.layers().size());
    EpilogRecord epilog;
    forward_micro_batch(model, batch, records, epilog, step, observe, loss_scale);
    Tensor d_hidden = model.head_backward_input(epilog, loss_scale);
    model.head_backward_weight(epilog);
    for (size_t i = model.layers().size(); i-- > 0;)
      d_hidden = model.layers()[i]->reference_backward(records[i], d_hidden);
    model.embed_backward(batch, d_hidden);
  }
  step.loss = step.ce_sum / static_cast<double>(denominator);
  finish_router_losses(step, model);
  return step;
}

StepLoss forward_only(const CausalLm& model, const std::vector<MicroBatch>& batches, ForwardObservation* observe) {
  StepLoss step;
  for (const MicroBatch& host_batch : batches) {
    host_batch.validate(model.config().vocab_size);
    const MicroBatch batch = host_batch.to(model.device());
    std::vector<LayerRecord> no_records;
    EpilogRecord epilog;
    forward_micro_batch(model, batch, no_records, epilog, step, observe, /*loss_scale=*/0.0);
  }
  step.loss = step.num_targets > 0 ? step.ce_sum / static_cast<double>(step.num_targets) : 0.0;
  finish_router_losses(step, model);
  return step;
}

}  // namespace moetrain::model
