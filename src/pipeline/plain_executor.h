// defines: PlainExecutor, the training step without pipeline parallelism (pp = 1): model::forward_backward's work,
// in the same order and with the same loss bookkeeping, run stage by stage through the decoder layers' five-stage
// contract, with expert parallelism's dispatch (stage 2) and combine (stage 4) between the stages when an ep
// communicator is given (dist/expert_parallel.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"

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

 private:
  struct LayerState;

  void check_micro_batch_count(int64_t count, const std::string& local_error);
  void forward(const model::MicroBatch& batch, std::vector<LayerState>& layers, model::EpilogRecord& epilog,
               model::StepLoss& step);
  Tensor backward(const Tensor& d_out, std::vector<LayerState>& layers);

  const model::CausalLm& model_;
  dist::Communicator* ep_;
};

}  // namespace moetrain::pipeline
