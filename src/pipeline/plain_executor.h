// defines: PlainExecutor, the training step without pipeline parallelism (pp = 1): model::forward_backward's work,
// in the same order and with the same loss bookkeeping, run stage by stage through the decoder layers' five-stage
// contract, with expert parallelism's dispatch (stage 2) and combine (stage 4) between the stages when an ep
// communicator is given (pipeline/expert_exchange.h: each token sent once per destination rank); and its forward alone
// (run_forward), the path `moetrain score` runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "pipeline/parameter_hooks.h"

namespace moetrain::pipeline {

class PlainExecutor {
 public:
  // `model` must outlive the executor; gradients accumulate into its parameter gradients (the caller zeroes them).
  // `ep` null: no expert parallelism (stages 2 and 4 pass through; the result equals model::forward_backward bit for
  // bit). Otherwise the ep ranks are also data ranks, each with its own micro-batches; every rank holds the whole
  // expert bank but computes only its E / ep experts, so its gradients of the other experts stay 0 (and its
  // non-expert gradients cover its own micro-batches only): the caller sums gradients over dp x ep.
  PlainExecutor(const model::CausalLm& model, dist::Communicator* ep);

  // Forward and backward of every micro-batch in order. The loss scale is 1 / global_num_targets when it is > 0
  // (the count over every data-parallel rank, ep ranks included), else 1 / this rank's counted targets. The returned
  // loss covers this rank's micro-batches (ce_sum, num_targets, num_tokens are this rank's; loss = ce_sum / the
  // denominator). With ep, every ep rank must pass the same number of micro-batches (checked, collectively).
  model::StepLoss run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets = 0);

  // Forward only of every micro-batch in order (the scoring path): the same forward as run_step, with the ep
  // exchange when ep is given, no backward, each micro-batch's records dropped once it ran. Returns per micro-batch
  // its token log-probs, f32 [T] on the CPU (model::token_logprobs_from_losses of the head's per-token losses; +0.0
  // where the target is -100); without ep they equal model::forward_only's ForwardObservation::token_logprobs bit for
  // bit. With ep, every ep rank must pass the same number of micro-batches (checked, collectively; a rank's bad
  // micro-batch stops every rank).
  std::vector<Tensor> run_forward(const std::vector<model::MicroBatch>& batches);

  // Called around each part of the model (ZeRO-3 gathers and frees its parameters there: train/fully_sharded.h);
  // null: none. Must outlive the executor's steps.
  void set_parameter_hooks(ParameterHooks* hooks) { hooks_ = hooks; }
  // Whether the expert dispatch sends each token once per destination rank (default) or every (token, expert)
  // row (ExpertExchange::create).
  void set_expert_deduplication(bool on) { deduplicate_ = on; }

 private:
  struct LayerState;

  void check_micro_batch_count(int64_t count, const std::string& local_error);
  void forward(const model::MicroBatch& batch, std::vector<LayerState>& layers, model::EpilogRecord& epilog,
               model::StepLoss& step);
  Tensor backward(const Tensor& d_out, std::vector<LayerState>& layers);

  const model::CausalLm& model_;
  dist::Communicator* ep_;
  ParameterHooks* hooks_ = nullptr;
  bool deduplicate_ = true;
};

}  // namespace moetrain::pipeline
