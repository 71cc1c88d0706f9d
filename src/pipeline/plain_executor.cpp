// defines: the pp = 1 training step (and its forward alone) through the one layer driver, with the expert-parallel
// dispatch and combine; the single-rank drivers on top of it.
#include "pipeline/plain_executor.h"

#include <algorithm>

#include "core/error.h"

namespace moetrain::pipeline {

namespace {

// The whole model as the one stage of a pp = 1 run.
StageLayers whole_model(const model::CausalLm& model) {
  StageLayers stage;
  stage.stage = 0;
  stage.rank = 0;
  stage.first_layer = 0;
  stage.end_layer = static_cast<int64_t>(model.layers().size());
  stage.has_embedding = true;
  stage.has_final_norm = true;
  stage.has_head = true;
  return stage;
}

void observe_forward(model::ForwardObservation* observe, ChunkForward& out) {
  if (observe == nullptr) return;
  observe->logits.push_back(out.logits);
  observe->router_logits.push_back(std::move(out.router_logits));
  observe->token_logprobs.push_back(out.token_logprobs);
}

// A step's values as its micro-batches leave them: the cross-entropy sums and router losses may still be on the device
// until the step's end, so that the host never waits for the GPU between micro-batches.
struct StepParts {
  std::vector<model::LossSum> losses;
  std::vector<model::RouterLossValues> router_losses;
  std::vector<int64_t> router_layers;
  int64_t num_tokens = 0;

  void add(ChunkForward& out, const model::MicroBatch& batch) {
    losses.push_back(std::move(out.loss));
    num_tokens += batch.num_tokens();
    for (auto& [layer, values] : out.router_losses) {
      router_losses.push_back(values);
      router_layers.push_back(layer);
    }
  }

  // The step's sums in micro-batch order (the order of the f64 additions the loss has always had).
  model::StepLoss sum() {
    model::resolve_losses(losses);
    model::StepLoss step;
    for (const model::LossSum& l : losses) {
      step.ce_sum += l.ce_sum();
      step.num_targets += l.num_targets();
    }
    step.num_tokens = num_tokens;
    return step;
  }
};

}  // namespace

void finish_router_losses(model::StepLoss& step, std::vector<model::RouterLossValues>& values,
                          const std::vector<int64_t>& layers, const model::CausalLm& model) {
  MT_CHECK(layers.size() == values.size(), "router losses: {} values but {} layer indices", values.size(),
           layers.size());
  model::resolve_all(values);
  for (const model::RouterLossValues& v : values) {
    step.load_balance += v.load_balance * static_cast<double>(v.tokens);
    step.z_loss += v.z_loss * static_cast<double>(v.tokens);
    step.device_balance += v.device_balance * static_cast<double>(v.tokens);
  }
  // Each MoE layer's place among the MoE layers (-1: dense).
  std::vector<int64_t> moe_index;
  int64_t moe_layers = 0;
  for (const auto& layer : model.layers()) moe_index.push_back(layer->has_experts() ? moe_layers++ : -1);
  step.layer_load_balance.clear();
  if (!values.empty()) {
    step.layer_load_balance.assign(static_cast<size_t>(moe_layers), 0.0);
    for (size_t i = 0; i < values.size(); ++i) {
      const int64_t at = moe_index.at(static_cast<size_t>(layers[i]));
      MT_CHECK(at >= 0, "router losses: a value for decoder layer {}, which has no experts", layers[i]);
      step.layer_load_balance[static_cast<size_t>(at)] +=
          values[i].load_balance * static_cast<double>(values[i].tokens);
    }
  }
  const double weight = static_cast<double>(step.num_tokens) * static_cast<double>(std::max<int64_t>(moe_layers, 1));
  if (weight > 0.0) {  // no micro-batches (possible with ep and a global count): no router losses
    step.load_balance /= weight;
    step.z_loss /= weight;
    step.device_balance /= weight;
    for (double& lb : step.layer_load_balance) lb /= static_cast<double>(step.num_tokens);
  }
}

PlainExecutor::PlainExecutor(const model::CausalLm& model, dist::Communicator* ep)
    : model_(model), ep_(ep), chunk_(model, whole_model(model), ep) {}

// Every ep rank must run the same number of micro-batches (each MoE layer's exchange is collective); one all_gather
// of {count, failed} lets every rank fail together, before any exchange, when a rank's input is bad.
void PlainExecutor::check_micro_batch_count(int64_t count, const std::string& local_error) {
  const int n = ep_->size();
  Tensor mine = Tensor::from_vector<int64_t>({count, local_error.empty() ? 0 : 1}, {2});
  if (!model_.device().is_cpu()) mine = mine.to(model_.device());
  Tensor all = Tensor::empty({static_cast<int64_t>(n), 2}, DType::I64, model_.device());
  ep_->all_gather(default_stream(model_.device()), all, mine);
  const std::vector<int64_t> host = all.to_vector<int64_t>();
  if (!local_error.empty()) MT_FAIL("{}", local_error);
  for (int p = 0; p < n; ++p) {
    MT_CHECK(host[static_cast<size_t>(2 * p + 1)] == 0,
             "plain executor: ep rank {} of '{}' refused its micro-batches (its own error says why); rank {} stops too",
             p, ep_->name(), ep_->rank());
  }
  for (int p = 0; p < n; ++p) {
    MT_CHECK(host[static_cast<size_t>(2 * p)] == count,
             "plain executor: every rank of '{}' must run the same number of micro-batches (the expert exchange is "
             "collective); rank {} has {} but rank {} has {}",
             ep_->name(), ep_->rank(), count, p, host[static_cast<size_t>(2 * p)]);
  }
}

int64_t PlainExecutor::validate(const std::vector<model::MicroBatch>& batches, bool need_targets,
                                int64_t global_num_targets) {
  int64_t local_targets = 0;
  std::string error;
  try {
    for (const model::MicroBatch& b : batches) {
      b.validate(model_.config().vocab_size);
      local_targets += b.num_targets();
    }
    MT_CHECK(!need_targets || global_num_targets > 0 || local_targets > 0,
             "plain executor: the step has no counted targets (every target is -100) and no global count was given");
  } catch (const Error& e) {
    if (ep_ == nullptr) throw;
    error = e.what();
  }
  if (ep_ != nullptr) check_micro_batch_count(static_cast<int64_t>(batches.size()), error);
  return local_targets;
}

std::vector<Tensor> PlainExecutor::run_forward(const std::vector<model::MicroBatch>& batches, model::StepLoss* step,
                                               model::ForwardObservation* observe) {
  validate(batches, false, 0);
  chunk_.set_observe(observe != nullptr, observe != nullptr && observe->keep_logits);
  const std::vector<model::MicroBatch> on_device = model::to_device(batches, model_.device());
  StepParts parts;
  std::vector<Tensor> logprobs;
  logprobs.reserve(batches.size());
  for (size_t i = 0; i < on_device.size(); ++i) {
    ChunkForward out = chunk_.forward(static_cast<int>(i), on_device[i], Tensor(), /*loss_scale=*/0.0);
    chunk_.drop(static_cast<int>(i));
    logprobs.push_back(out.token_logprobs);
    observe_forward(observe, out);
    parts.add(out, on_device[i]);
  }
  model::StepLoss sums = parts.sum();
  sums.loss = sums.num_targets > 0 ? sums.ce_sum / static_cast<double>(sums.num_targets) : 0.0;
  finish_router_losses(sums, parts.router_losses, parts.router_layers, model_);
  if (step != nullptr) *step = sums;
  return logprobs;
}

model::StepLoss PlainExecutor::run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets,
                                        model::ForwardObservation* observe) {
  const int64_t local_targets = validate(batches, true, global_num_targets);
  const int64_t denominator = global_num_targets > 0 ? global_num_targets : local_targets;
  const double loss_scale = 1.0 / static_cast<double>(denominator);
  chunk_.set_observe(observe != nullptr, observe != nullptr && observe->keep_logits);
  StepParts parts;
  try {
    const std::vector<model::MicroBatch> on_device = model::to_device(batches, model_.device());
    for (size_t i = 0; i < on_device.size(); ++i) {
      const int mb = static_cast<int>(i);
      ChunkForward out = chunk_.forward(mb, on_device[i], Tensor(), loss_scale);
      chunk_.backward_full(mb, Tensor(), loss_scale);
      observe_forward(observe, out);
      parts.add(out, on_device[i]);
    }
    chunk_.finish_expert_weights();
  } catch (...) {
    chunk_.clear();  // a failed step leaves no record (nor held weight work) for the next one
    throw;
  }
  model::StepLoss step = parts.sum();
  step.loss = step.ce_sum / static_cast<double>(denominator);
  finish_router_losses(step, parts.router_losses, parts.router_layers, model_);
  return step;
}

model::StepLoss forward_backward(const model::CausalLm& model, const std::vector<model::MicroBatch>& batches,
                                 int64_t global_num_targets, model::ForwardObservation* observe) {
  PlainExecutor executor(model, nullptr);
  return executor.run_step(batches, global_num_targets, observe);
}

model::StepLoss forward_only(const model::CausalLm& model, const std::vector<model::MicroBatch>& batches,
                             model::ForwardObservation* observe) {
  PlainExecutor executor(model, nullptr);
  model::StepLoss step;
  executor.run_forward(batches, &step, observe);
  return step;
}

}  // namespace moetrain::pipeline
