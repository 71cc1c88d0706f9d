// defines: the pp = 1 training step (and its forward alone) through the five stages, with the expert-parallel
// dispatch and combine.
#include "pipeline/plain_executor.h"

#include <algorithm>

#include "core/error.h"
#include "pipeline/expert_exchange.h"

namespace moetrain::pipeline {

// One layer's records for one micro-batch, from its forward to its backward.
struct PlainExecutor::LayerState {
  model::Stage1Record stage1;
  model::Stage3Record stage3;
  model::Stage5Record stage5;
  model::Stage1Out stage1_out;
  ExpertExchange plan;  // defined when the layer's rows crossed the ep ranks
};

PlainExecutor::PlainExecutor(const model::CausalLm& model, dist::Communicator* ep) : model_(model), ep_(ep) {
  if (ep_ != nullptr && model.config().num_experts > 0) {
    MT_CHECK(model.config().num_experts % ep_->size() == 0,
             "plain executor: num_experts ({}) is not divisible by the size of communicator '{}' ({})",
             model.config().num_experts, ep_->name(), ep_->size());
  }
}

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

void PlainExecutor::forward(const model::MicroBatch& batch, std::vector<LayerState>& layers,
                            model::EpilogRecord& epilog, model::StepLoss& step) {
  Stream& stream = default_stream(model_.device());
  if (hooks_) hooks_->before_forward(ModelPart::embedding());
  Tensor hidden = model_.embed_forward(batch);
  if (hooks_) hooks_->after_forward(ModelPart::embedding());
  model_.round_boundary(hidden);
  for (size_t i = 0; i < model_.layers().size(); ++i) {
    const model::DecoderLayer& layer = *model_.layers()[i];
    LayerState& ls = layers[i];
    if (hooks_) hooks_->before_forward(ModelPart::decoder_layer(layer.index()));
    ls.stage1_out = layer.stage1_forward(ls.stage1, hidden, batch);
    Tensor rows = ls.stage1_out.dispatched;
    Tensor offsets = ls.stage1_out.group_offsets;
    const bool exchange = ep_ != nullptr && layer.has_experts();
    if (exchange) {  // stage 2
      const ops::RoutingPlan& routing = ls.stage1_out.routing.plan;
      ls.plan = ExpertExchange::create(*ep_, stream, offsets, routing.row_choice, ls.stage1_out.routing.topk_index,
                                       model_.config().num_experts, deduplicate_);
      rows = ls.plan.dispatch(*ep_, stream, rows);
      offsets = ls.plan.local_group_offsets();
    }
    Tensor expert_out = layer.stage3_forward(ls.stage3, rows, offsets);
    if (exchange) expert_out = ls.plan.combine(*ep_, stream, expert_out);  // stage 4
    hidden = layer.stage5_forward(ls.stage5, expert_out, ls.stage1_out);
    if (hooks_) hooks_->after_forward(ModelPart::decoder_layer(layer.index()));
    model_.round_boundary(hidden);
    // As model::forward_backward: the auxiliary router losses weighted by the micro-batch's tokens.
    ls.stage1.aux.resolve();  // CUDA: the values come back to the host here
    step.load_balance += ls.stage1.aux.load_balance * static_cast<double>(ls.stage1.aux.tokens);
    step.z_loss += ls.stage1.aux.z_loss * static_cast<double>(ls.stage1.aux.tokens);
  }
  step.num_tokens += batch.num_tokens();
  if (hooks_) hooks_->before_forward(ModelPart::head());  // the caller ends the head's use (backward or not)
  const model::LossSum sum = model_.head_forward(epilog, hidden, batch);
  step.ce_sum += sum.ce_sum;
  step.num_targets += sum.num_targets;
}

// The layers' backward in reverse, each in DecoderLayer::reference_backward's order, with the transposes of stages
// 4 and 2 around stage 3.
Tensor PlainExecutor::backward(const Tensor& d_out, std::vector<LayerState>& layers) {
  Stream& stream = default_stream(model_.device());
  Tensor d_hidden = d_out;
  for (size_t i = model_.layers().size(); i-- > 0;) {
    const model::DecoderLayer& layer = *model_.layers()[i];
    LayerState& ls = layers[i];
    if (hooks_) hooks_->before_backward(ModelPart::decoder_layer(layer.index()));
    const model::Stage5Grads grads = layer.stage5_backward_input(ls.stage5, d_hidden);
    Tensor d_combined = grads.d_combined;
    if (ls.plan.defined()) d_combined = ls.plan.combine_backward(*ep_, stream, d_combined);
    Tensor d_dispatched = layer.stage3_backward_input(ls.stage3, d_combined);
    layer.stage3_backward_weight(ls.stage3);
    if (ls.plan.defined()) d_dispatched = ls.plan.dispatch_backward(*ep_, stream, d_dispatched);
    d_hidden = layer.stage1_backward_input(ls.stage1, grads, d_dispatched);
    layer.stage1_backward_weight(ls.stage1);
    if (hooks_) hooks_->after_backward(ModelPart::decoder_layer(layer.index()));
    ls = LayerState{};
  }
  return d_hidden;
}

std::vector<Tensor> PlainExecutor::run_forward(const std::vector<model::MicroBatch>& batches) {
  std::string error;
  try {
    for (const model::MicroBatch& b : batches) b.validate(model_.config().vocab_size);
  } catch (const Error& e) {
    if (ep_ == nullptr) throw;
    error = e.what();
  }
  if (ep_ != nullptr) check_micro_batch_count(static_cast<int64_t>(batches.size()), error);

  std::vector<Tensor> logprobs;
  logprobs.reserve(batches.size());
  for (const model::MicroBatch& host_batch : batches) {
    const model::MicroBatch batch = host_batch.to(model_.device());
    std::vector<LayerState> layers(model_.layers().size());
    model::EpilogRecord epilog;
    model::StepLoss step;  // router losses and loss sums of the forward, unused here
    forward(batch, layers, epilog, step);
    if (hooks_) hooks_->after_forward(ModelPart::head());
    logprobs.push_back(model::token_logprobs_from_losses(epilog.losses, batch.targets));
  }
  return logprobs;
}

model::StepLoss PlainExecutor::run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets) {
  // Validate everything first (with ep, every rank learns whether every rank can go on).
  int64_t local_targets = 0;
  std::string error;
  try {
    for (const model::MicroBatch& b : batches) {
      b.validate(model_.config().vocab_size);
      local_targets += b.num_targets();
    }
    MT_CHECK(global_num_targets > 0 || local_targets > 0,
             "plain executor: the step has no counted targets (every target is -100) and no global count was given");
  } catch (const Error& e) {
    if (ep_ == nullptr) throw;
    error = e.what();
  }
  if (ep_ != nullptr) check_micro_batch_count(static_cast<int64_t>(batches.size()), error);

  const int64_t denominator = global_num_targets > 0 ? global_num_targets : local_targets;
  const double loss_scale = 1.0 / static_cast<double>(denominator);
  model::StepLoss step;
  for (const model::MicroBatch& host_batch : batches) {
    const model::MicroBatch batch = host_batch.to(model_.device());
    std::vector<LayerState> layers(model_.layers().size());
    model::EpilogRecord epilog;
    forward(batch, layers, epilog, step);
    if (hooks_) hooks_->before_backward(ModelPart::head());
    Tensor d_hidden = model_.head_backward_input(epilog, loss_scale);
    model_.head_backward_weight(epilog);
    if (hooks_) hooks_->after_backward(ModelPart::head());
    d_hidden = backward(d_hidden, layers);
    if (hooks_) hooks_->before_backward(ModelPart::embedding());
    model_.embed_backward(batch, d_hidden);
    if (hooks_) hooks_->after_backward(ModelPart::embedding());
  }
  step.loss = step.ce_sum / static_cast<double>(denominator);
  // As model::forward_backward: token-weighted over the micro-batches, averaged over the MoE layers.
  int64_t moe_layers = 0;
  for (const auto& layer : model_.layers()) moe_layers += layer->has_experts() ? 1 : 0;
  const double weight = static_cast<double>(step.num_tokens) * static_cast<double>(std::max<int64_t>(moe_layers, 1));
  if (weight > 0.0) {  // no micro-batches (possible with ep and a global count): no router losses
    step.load_balance /= weight;
    step.z_loss /= weight;
  }
  return step;
}

}  // namespace moetrain::pipeline
