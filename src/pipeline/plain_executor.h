// defines: PlainExecutor, the training step without pipeline parallelism (pp = 1): the one layer driver
// (pipeline/stage_chunk.h) over a single stage that holds the whole model, with expert parallelism's dispatch
// (stage 2) and combine (stage 4) between the stages when an ep communicator is given (pipeline/expert_exchange.h:
// each token sent once per destination rank); and its forward alone (run_forward), the path `moetrain score` runs.
// forward_backward and forward_only are this executor without expert parallelism: the single-rank path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "pipeline/parameter_hooks.h"
#include "pipeline/stage_chunk.h"

namespace moetrain::pipeline {

class PlainExecutor {
 public:
  // `model` must outlive the executor; gradients accumulate into its parameter gradients (the caller zeroes them).
  // `ep` null: no expert parallelism (stages 2 and 4 pass through). Otherwise the ep ranks are also data ranks, each
  // with its own micro-batches; every rank holds the whole expert bank but computes only its E / ep experts, so its
  // gradients of the other experts stay 0 (and its non-expert gradients cover its own micro-batches only): the
  // caller sums gradients over dp x ep.
  PlainExecutor(const model::CausalLm& model, dist::Communicator* ep);

  // Forward and backward of every micro-batch in order. The loss scale is 1 / global_num_targets when it is > 0
  // (the count over every data-parallel rank, ep ranks included), else 1 / this rank's counted targets. The returned
  // loss covers this rank's micro-batches (ce_sum, num_targets, num_tokens are this rank's; loss = ce_sum / the
  // denominator). With ep, every ep rank must pass the same number of micro-batches (checked, collectively).
  // `observe` (may be null) receives the logits, router logits and token log-probs of each micro-batch.
  model::StepLoss run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets = 0,
                           model::ForwardObservation* observe = nullptr);

  // Forward only of every micro-batch in order (the scoring path): the same forward as run_step, with the ep
  // exchange when ep is given, no backward, each micro-batch's records dropped once it ran. Returns per micro-batch
  // its token log-probs, f32 [T] on the CPU (model::token_logprobs_from_losses of the head's per-token losses; +0.0
  // where the target is -100). With ep, every ep rank must pass the same number of micro-batches (checked,
  // collectively; a rank's bad micro-batch stops every rank). `step` and `observe` (may be null) receive the loss and
  // what observers look at.
  std::vector<Tensor> run_forward(const std::vector<model::MicroBatch>& batches, model::StepLoss* step = nullptr,
                                  model::ForwardObservation* observe = nullptr);

  // Called around each part of the model (ZeRO-3 gathers and frees its parameters there: train/fully_sharded.h);
  // null: none. Must outlive the executor's steps.
  void set_parameter_hooks(ParameterHooks* hooks) { chunk_.set_parameter_hooks(hooks); }
  // Whether the expert dispatch sends each token once per destination rank (default) or every (token, expert)
  // row (ExpertExchange::create).
  void set_expert_deduplication(bool on) { chunk_.set_expert_deduplication(on); }
  // The expert banks' weight gradients once a step over every micro-batch's rows (model.expert_weight_gradient =
  // step: StageChunk::set_expert_weights_per_step), instead of after each micro-batch's backward. Not with hooks.
  void set_expert_weights_per_step(bool on) { chunk_.set_expert_weights_per_step(on); }

 private:
  void check_micro_batch_count(int64_t count, const std::string& local_error);
  // Validates every micro-batch (with ep, every rank learns whether every rank can go on) and counts the targets.
  int64_t validate(const std::vector<model::MicroBatch>& batches, bool need_targets, int64_t global_num_targets);

  const model::CausalLm& model_;
  dist::Communicator* ep_;
  StageChunk chunk_;  // the whole model as one stage
};

// The single-rank path: PlainExecutor without expert parallelism. Forward and backward of every micro-batch in order,
// accumulating into the parameter gradients (which the caller zeroes); the loss scale is 1 / the targets counted over
// all the micro-batches, or 1 / global_num_targets when that is given (> 0).
model::StepLoss forward_backward(const model::CausalLm& model, const std::vector<model::MicroBatch>& batches,
                                 int64_t global_num_targets = 0, model::ForwardObservation* observe = nullptr);
// Forward only; fills `observe` when given.
model::StepLoss forward_only(const model::CausalLm& model, const std::vector<model::MicroBatch>& batches,
                             model::ForwardObservation* observe = nullptr);

// Adds a forward's router-loss values to a step's sums (resolving them with one wait) and averages them: token-
// weighted over the micro-batches, over the model's MoE layers. Every executor reports its step's router losses so.
// `layers[i]` is the decoder layer of values[i]: step.layer_load_balance gets each MoE layer's token-weighted load
// balance (summed over the micro-batches in order, divided by step.num_tokens), as DualPipeVExecutor computes it.
void finish_router_losses(model::StepLoss& step, std::vector<model::RouterLossValues>& values,
                          const std::vector<int64_t>& layers, const model::CausalLm& model);

}  // namespace moetrain::pipeline
