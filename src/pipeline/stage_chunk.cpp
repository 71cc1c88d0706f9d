// defines: a pipeline stage's forward, backward_input and backward_weight, cut into stage-sized steps, with the
// expert-parallel exchanges as stages 2 and 4.
#include "pipeline/stage_chunk.h"

#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "ops/cuda/runtime.h"
#include "pipeline/expert_exchange.h"

namespace moetrain::pipeline {

// One layer's records for one micro-batch and the tensors in flight between its stages.
struct StageChunk::LayerState {
  std::unique_ptr<model::LayerRecord> record;  // the layer's own, from stage 1's forward to its last backward_weight
  model::Dispatch dispatch;                    // stage 1's rows until stage 2 took them
  Tensor dispatched, expert_out, combined;     // forward: rows after stage 2, after stage 3, after stage 4
  Tensor group_offsets;                        // stage 3's rows per expert (the plan's local offsets with ep)
  ExpertExchange plan;                         // defined when the layer's rows cross the ep ranks (forward to backward)
  bool rows_exchanged = false;                 // stage 3 ran on rows an expert exchange delivered
  Tensor d_combined, d_expert_out, d_dispatched_local, d_dispatched;
  bool exchange_in_flight = false;  // an exchange was queued on the communication stream; compute has not waited
};

struct StageChunk::MicroBatchState {
  enum class Phase { Forward, ForwardDone, Backward, BackwardInputDone };
  int microbatch = 0;
  Phase phase = Phase::Forward;
  model::MicroBatch batch;  // the records (attention, epilog) point into it: the state never moves
  std::vector<LayerState> layers;
  model::EpilogRecord epilog;
  Tensor hidden;                     // the activation flowing through the forward steps
  Tensor grad;                       // the gradient flowing through the backward steps
  Tensor d_embed;                    // embedding stage: the gradient of its output, kept for the weight pass
  double loss_scale = 0.0;           // what the head's forward was given
  bool head_backward_begun = false;  // hooks: before_backward(head) ran (a fused head's forward needs it)
  bool weight_done = false;
  ChunkForward result;
};

StageChunk::StageChunk(const model::CausalLm& model, const StageLayers& stage, dist::Communicator* ep)
    : model_(model), stage_(stage), ep_(ep) {
  const int64_t num_layers = static_cast<int64_t>(model.layers().size());
  MT_CHECK(stage.first_layer >= 0 && stage.first_layer < stage.end_layer && stage.end_layer <= num_layers,
           "pipeline: stage {} holds layers [{}, {}) but the model has {} decoder layers; expected a non-empty range "
           "inside [0, {})",
           stage.stage, stage.first_layer, stage.end_layer, num_layers, num_layers);
  MT_CHECK(stage.has_final_norm == stage.has_head,
           "pipeline: stage {} has the final norm {} the head; the two must be on the same (last) stage", stage.stage,
           stage.has_final_norm ? "but not" : "without");
  if (ep_ != nullptr && model.config().num_experts > 0) {
    MT_CHECK(model.config().num_experts % ep_->size() == 0,
             "pipeline: stage {}: num_experts ({}) is not divisible by the size of communicator '{}' ({})", stage.stage,
             model.config().num_experts, ep_->name(), ep_->size());
  }
}

// The exchanges run on the communication stream (core/device.h), after the compute queued so far: the host goes on
// queueing the other micro-batch's stages of an overlapped pair on the compute stream while the all-to-all runs.
// Their temporaries live in that stream's order (StreamScope), their inputs are dropped there, and the step that
// consumes their output first makes compute wait for it (await_exchange).
void StageChunk::expert_dispatch(LayerState& ls) const {
  const model::Dispatch dispatch = std::move(ls.dispatch);
  ls.dispatch = model::Dispatch{};
  ls.dispatched = dispatch.rows;
  ls.group_offsets = dispatch.group_offsets;
  if (ep_ == nullptr || !dispatch.routed()) return;
  Stream& comm = begin_exchange(ls);
  ops::cuda::StreamScope scope(comm);
  ls.plan = ExpertExchange::create(*ep_, comm, ls.group_offsets, dispatch.row_choice, dispatch.topk_index,
                                   model_.config().num_experts, deduplicate_);
  ls.dispatched = ls.plan.dispatch(*ep_, comm, ls.dispatched);
  ls.rows_exchanged = true;
  ls.group_offsets = ls.plan.local_group_offsets();
}

void StageChunk::expert_combine(LayerState& ls) const {
  if (!ls.plan.defined()) {
    ls.combined = std::move(ls.expert_out);
    return;
  }
  Stream& comm = begin_exchange(ls);
  ops::cuda::StreamScope scope(comm);
  ls.combined = ls.plan.combine(*ep_, comm, ls.expert_out);
  ls.expert_out = Tensor();
}

void StageChunk::expert_combine_backward(LayerState& ls) const {
  const Tensor d_combined = std::move(ls.d_combined);
  ls.d_combined = Tensor();
  if (!ls.plan.defined()) {
    ls.d_expert_out = d_combined;
    return;
  }
  Stream& comm = begin_exchange(ls);
  ops::cuda::StreamScope scope(comm);
  ls.d_expert_out = ls.plan.combine_backward(*ep_, comm, d_combined);
}

void StageChunk::expert_dispatch_backward(LayerState& ls) const {
  if (!ls.plan.defined()) {
    ls.d_dispatched = std::move(ls.d_dispatched_local);
    return;
  }
  Stream& comm = begin_exchange(ls);
  ops::cuda::StreamScope scope(comm);
  ls.d_dispatched = ls.plan.dispatch_backward(*ep_, comm, ls.d_dispatched_local);
  ls.d_dispatched_local = Tensor();
  ls.plan = ExpertExchange{};
}

Stream& StageChunk::begin_exchange(LayerState& ls) const {
  Stream& comm = communication_stream(model_.device());
  stream_wait(comm, default_stream(model_.device()));
  ls.exchange_in_flight = true;
  return comm;
}

void StageChunk::await_exchange(LayerState& ls) const {
  if (!ls.exchange_in_flight) return;
  stream_wait(default_stream(model_.device()), communication_stream(model_.device()));
  ls.exchange_in_flight = false;
}

StageChunk::~StageChunk() = default;

void StageChunk::clear() {
  states_.clear();
  held_expert_weights_.clear();
}

void StageChunk::set_expert_weights_per_step(bool on) {
  MT_CHECK(held_expert_weights_.empty(),
           "pipeline: stage {} changes when it runs the expert weight gradients while it holds some; finish them first",
           stage_.stage);
  expert_weights_per_step_ = on;
}

void StageChunk::stage3_weight_work(int64_t i, LayerState& ls) {
  const model::DecoderLayer& layer = *model_.layers()[static_cast<size_t>(stage_.first_layer + i)];
  if (!expert_weights_per_step_ || !layer.has_experts()) {
    layer.stage3_backward_weight(*ls.record);
    return;
  }
  MT_CHECK(hooks_ == nullptr,
           "pipeline: stage {} holds the expert weight gradients for the step's end, but parameter hooks (ZeRO-3) free "
           "each layer's gradients after its backward",
           stage_.stage);
  held_expert_weights_[i].push_back(layer.take_stage3_weight_work(*ls.record, !ls.rows_exchanged));
}

void StageChunk::finish_expert_weights() {
  for (auto& [i, held] : held_expert_weights_) {
    const model::DecoderLayer& layer = *model_.layers()[static_cast<size_t>(stage_.first_layer + i)];
    std::vector<model::LayerRecord*> records;
    for (const std::unique_ptr<model::LayerRecord>& record : held) records.push_back(record.get());
    layer.stage3_backward_weight_together(records);
  }
  held_expert_weights_.clear();
}

StageChunk::MicroBatchState& StageChunk::state(int microbatch, const char* what) {
  const auto it = states_.find(microbatch);
  MT_CHECK(it != states_.end(),
           "pipeline: {} of micro-batch {} on stage {}, which holds no record of it (its forward "
           "did not run, or its backward_weight already freed it)",
           what, microbatch, stage_.stage);
  return *it->second;
}

std::vector<ChunkStep> StageChunk::plan_forward(int microbatch, const model::MicroBatch& batch, const Tensor& input,
                                                double loss_scale) {
  MT_CHECK(states_.count(microbatch) == 0, "pipeline: forward of micro-batch {} on stage {} ran twice in one step",
           microbatch, stage_.stage);
  if (stage_.has_embedding) {
    expect_defined(batch.input_ids, "pipeline: first stage's micro-batch input_ids");
  } else {
    expect_defined(input, "pipeline: stage input");
    MT_CHECK(input.dim() == 2 && input.size(1) == model_.config().hidden_size &&
                 input.size(0) == batch.position_ids.numel() && input.dtype() == model_.stream_dtype(),
             "pipeline: stage {} expects its input as {}[{}, {}] (T from the micro-batch's position_ids) but found {}",
             stage_.stage, dtype_name(model_.stream_dtype()), batch.position_ids.numel(), model_.config().hidden_size,
             input.describe());
  }
  if (stage_.has_head) {
    expect_defined(batch.targets, "pipeline: last stage's micro-batch targets");
    MT_CHECK(std::isfinite(loss_scale) && loss_scale >= 0.0,
             "pipeline: the loss stage's forward needs a finite loss scale >= 0 (0: forward only) but found {}",
             loss_scale);
  }

  auto owned = std::make_unique<MicroBatchState>();
  MicroBatchState& st = *owned;
  st.microbatch = microbatch;
  st.batch = batch;
  st.hidden = input;
  st.loss_scale = loss_scale;
  st.layers.resize(static_cast<size_t>(stage_.num_layers()));
  states_.emplace(microbatch, std::move(owned));

  std::vector<ChunkStep> steps;
  const std::string tag = fmt::format("F mb{}", microbatch);
  if (stage_.has_embedding)
    steps.push_back({tag + " embed", false, [this, &st] {
                       if (hooks_) hooks_->before_forward(ModelPart::embedding());
                       st.hidden = model_.embed_forward(st.batch);
                       if (hooks_) hooks_->after_forward(ModelPart::embedding());
                       model_.round_boundary(st.hidden);  // exact mode: every stage boundary is on the bf16 grid
                     }});
  for (int64_t i = 0; i < stage_.num_layers(); ++i) {
    const model::DecoderLayer& layer = *model_.layers()[static_cast<size_t>(stage_.first_layer + i)];
    LayerState& ls = st.layers[static_cast<size_t>(i)];
    const std::string l = fmt::format("{} L{}", tag, layer.index());
    steps.push_back({l + " s1", false, [this, &st, &ls, &layer] {
                       if (hooks_) hooks_->before_forward(ModelPart::decoder_layer(layer.index()));
                       ls.record = layer.new_record();
                       ls.dispatch = layer.stage1_forward(*ls.record, st.hidden, st.batch);
                       if (layer.has_experts()) {
                         // Left on the device (CUDA): the executor resolves a step's values with one wait.
                         st.result.router_losses.emplace_back(layer.index(), ls.record->aux);
                         if (observe_) st.result.router_logits.push_back(ls.record->router_logits);
                       }
                     }});
    steps.push_back({l + " s2", true, [this, &ls] { expert_dispatch(ls); }});
    steps.push_back({l + " s3", false, [this, &ls, &layer] {
                       await_exchange(ls);
                       ls.expert_out = layer.stage3_forward(*ls.record, ls.dispatched, ls.group_offsets);
                       ls.dispatched = Tensor();
                       ls.group_offsets = Tensor();
                     }});
    steps.push_back({l + " s4", true, [this, &ls] { expert_combine(ls); }});
    steps.push_back({l + " s5", false, [this, &st, &ls, &layer] {
                       await_exchange(ls);
                       st.hidden = layer.stage5_forward(*ls.record, ls.combined);
                       if (hooks_) hooks_->after_forward(ModelPart::decoder_layer(layer.index()));
                       model_.round_boundary(st.hidden);
                       ls.combined = Tensor();
                     }});
  }
  if (stage_.has_head) {
    steps.push_back({tag + " head", false, [this, &st] {
                       const bool training = st.loss_scale > 0.0;
                       if (hooks_) {
                         hooks_->before_forward(ModelPart::head());
                         // A fused head writes its weight gradient in the forward: the gradient must be live.
                         if (training && model_.head_is_fused(observe_logits_)) {
                           hooks_->before_backward(ModelPart::head());
                           st.head_backward_begun = true;
                         }
                       }
                       st.result.loss =
                           model_.head_forward(st.epilog, st.hidden, st.batch, st.loss_scale, observe_logits_);
                       if (hooks_ && !training) hooks_->after_forward(ModelPart::head());
                       // Read back (a host wait on CUDA) only when someone looks: a forward alone, or an observer.
                       if (!training || observe_)
                         st.result.token_logprobs =
                             model::token_logprobs_from_losses(st.epilog.losses, st.batch.targets);
                       // A training step's backward overwrites the logits with their gradient: an observer gets a copy.
                       if (observe_logits_) st.result.logits = training ? st.epilog.logits.clone() : st.epilog.logits;
                       st.hidden = Tensor();
                     }});
  }
  steps.push_back({tag + " done", false, [&st] { st.phase = MicroBatchState::Phase::ForwardDone; }});
  return steps;
}

ChunkForward StageChunk::finish_forward(int microbatch) {
  MicroBatchState& st = state(microbatch, "finish_forward");
  MT_CHECK(st.phase == MicroBatchState::Phase::ForwardDone,
           "pipeline: finish_forward of micro-batch {} on stage {} before its forward steps all ran", microbatch,
           stage_.stage);
  ChunkForward out = std::move(st.result);
  out.hidden = std::move(st.hidden);
  st.result = ChunkForward{};
  st.hidden = Tensor();
  return out;
}

std::vector<ChunkStep> StageChunk::plan_backward(int microbatch, const Tensor& d_output, double loss_scale,
                                                 bool with_weight) {
  MicroBatchState& st = state(microbatch, "backward");
  MT_CHECK(st.phase == MicroBatchState::Phase::ForwardDone, "pipeline: backward of micro-batch {} on stage {} {}",
           microbatch, stage_.stage,
           st.phase == MicroBatchState::Phase::Forward ? "before its forward finished" : "ran twice in one step");
  if (stage_.has_head) {
    MT_CHECK(!d_output.defined() && loss_scale > 0.0,
             "pipeline: the loss stage's backward starts from the loss: expected no output gradient and a positive "
             "loss scale, found {} and {}",
             d_output.defined() ? d_output.describe() : "none", loss_scale);
  } else {
    expect_defined(d_output, "pipeline: stage output gradient");
    MT_CHECK(d_output.dim() == 2 && d_output.size(0) == st.batch.position_ids.numel() &&
                 d_output.size(1) == model_.config().hidden_size && d_output.dtype() == model_.stream_dtype(),
             "pipeline: stage {} expects the gradient of its output as {}[{}, {}] but found {}", stage_.stage,
             dtype_name(model_.stream_dtype()), st.batch.position_ids.numel(), model_.config().hidden_size,
             d_output.describe());
  }
  st.phase = MicroBatchState::Phase::Backward;
  st.grad = d_output;

  MT_CHECK(hooks_ == nullptr || with_weight,
           "pipeline: stage {} runs parameter hooks, which need each backward's weight work at once", stage_.stage);

  std::vector<ChunkStep> steps;
  const std::string tag = fmt::format("B mb{}", microbatch);
  if (stage_.has_head) {
    steps.push_back({tag + " head", false, [this, &st, loss_scale, with_weight] {
                       if (hooks_ && !st.head_backward_begun) hooks_->before_backward(ModelPart::head());
                       st.grad = model_.head_backward_input(st.epilog, loss_scale);
                       if (with_weight) model_.head_backward_weight(st.epilog);
                       if (hooks_) hooks_->after_backward(ModelPart::head());
                     }});
  }
  for (int64_t i = stage_.num_layers(); i-- > 0;) {
    const model::DecoderLayer& layer = *model_.layers()[static_cast<size_t>(stage_.first_layer + i)];
    LayerState& ls = st.layers[static_cast<size_t>(i)];
    const std::string l = fmt::format("{} L{}", tag, layer.index());
    steps.push_back({l + " s5", false, [this, &st, &ls, &layer] {
                       if (hooks_) hooks_->before_backward(ModelPart::decoder_layer(layer.index()));
                       ls.d_combined = layer.stage5_backward_input(*ls.record, st.grad);
                     }});
    steps.push_back({l + " s4", true, [this, &ls] { expert_combine_backward(ls); }});
    steps.push_back({l + " s3", false, [this, &ls, &layer, i, with_weight] {
                       await_exchange(ls);
                       ls.d_dispatched_local = layer.stage3_backward_input(*ls.record, ls.d_expert_out);
                       ls.d_expert_out = Tensor();
                       if (with_weight) stage3_weight_work(i, ls);
                     }});
    steps.push_back({l + " s2", true, [this, &ls] { expert_dispatch_backward(ls); }});
    steps.push_back({l + " s1", false, [this, &st, &ls, &layer, with_weight] {
                       await_exchange(ls);
                       st.grad = layer.stage1_backward_input(*ls.record, ls.d_dispatched);
                       ls.d_dispatched = Tensor();
                       if (with_weight) {
                         layer.stage1_backward_weight(*ls.record);
                         ls.record.reset();
                       }
                       if (hooks_) hooks_->after_backward(ModelPart::decoder_layer(layer.index()));
                     }});
  }
  steps.push_back({tag + " done", false, [this, &st, with_weight] {
                     if (stage_.has_embedding) {
                       st.d_embed = st.grad;
                       st.grad = Tensor();
                       if (with_weight) {
                         if (hooks_) hooks_->before_backward(ModelPart::embedding());
                         model_.embed_backward(st.batch, st.d_embed);
                         if (hooks_) hooks_->after_backward(ModelPart::embedding());
                       }
                     }
                     st.weight_done = with_weight;
                     st.phase = MicroBatchState::Phase::BackwardInputDone;
                   }});
  return steps;
}

Tensor StageChunk::finish_backward(int microbatch) {
  MicroBatchState& st = state(microbatch, "finish_backward");
  MT_CHECK(st.phase == MicroBatchState::Phase::BackwardInputDone,
           "pipeline: finish_backward of micro-batch {} on stage {} before its backward steps all ran", microbatch,
           stage_.stage);
  Tensor d_input = std::move(st.grad);
  st.grad = Tensor();
  if (st.weight_done) states_.erase(microbatch);  // a full backward: the records are no longer needed
  return d_input;
}

void StageChunk::run_weight_work(MicroBatchState& st) {
  if (stage_.has_head) model_.head_backward_weight(st.epilog);
  for (int64_t i = stage_.num_layers(); i-- > 0;) {
    const model::DecoderLayer& layer = *model_.layers()[static_cast<size_t>(stage_.first_layer + i)];
    LayerState& ls = st.layers[static_cast<size_t>(i)];
    stage3_weight_work(i, ls);
    layer.stage1_backward_weight(*ls.record);
    ls.record.reset();
  }
  if (stage_.has_embedding) model_.embed_backward(st.batch, st.d_embed);
}

ChunkForward StageChunk::forward(int microbatch, const model::MicroBatch& batch, const Tensor& input,
                                 double loss_scale) {
  for (const ChunkStep& step : plan_forward(microbatch, batch, input, loss_scale)) step.run();
  return finish_forward(microbatch);
}

Tensor StageChunk::backward_input(int microbatch, const Tensor& d_output, double loss_scale) {
  for (const ChunkStep& step : plan_backward(microbatch, d_output, loss_scale, false)) step.run();
  return finish_backward(microbatch);
}

Tensor StageChunk::backward_full(int microbatch, const Tensor& d_output, double loss_scale) {
  for (const ChunkStep& step : plan_backward(microbatch, d_output, loss_scale, true)) step.run();
  return finish_backward(microbatch);
}

void StageChunk::drop(int microbatch) {
  MicroBatchState& st = state(microbatch, "drop");
  MT_CHECK(st.phase == MicroBatchState::Phase::ForwardDone,
           "pipeline: drop of micro-batch {} on stage {} needs its forward finished and no backward started",
           microbatch, stage_.stage);
  states_.erase(microbatch);
}

void StageChunk::backward_weight(int microbatch) {
  MicroBatchState& st = state(microbatch, "backward_weight");
  MT_CHECK(st.phase == MicroBatchState::Phase::BackwardInputDone && !st.weight_done,
           "pipeline: backward_weight of micro-batch {} on stage {} needs its backward_input to have run (and its "
           "weight work not yet)",
           microbatch, stage_.stage);
  run_weight_work(st);
  states_.erase(microbatch);
}

}  // namespace moetrain::pipeline
