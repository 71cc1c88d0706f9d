// defines: cross-entropy over next-token targets with an ignore index. The per-token losses and
// log-sum-exps are kept so that the loss sum and its count can be reduced in a fixed order and
// the backward can be scaled by the global token count (docs/design.md section 1).
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

constexpr int kIgnoreIndex = -100;

// losses [T] = lse - logits[t, target] (0 where target == ignore_index); lse [T]. logits [T, V],
// targets i32 [T]; a target outside [0, V) that is not the ignore index is an error.
void cross_entropy_forward(Stream& stream, Tensor losses, Tensor lse, const Tensor& logits, const Tensor& targets,
                           int ignore_index = kIgnoreIndex);
// dlogits [T, V] = scale * (softmax(logits) - onehot(target)) on counted rows, 0 on ignored rows. dlogits may be
// logits itself (each element is read before it is written): the gradient then replaces the logits in their buffer.
void cross_entropy_backward(Stream& stream, Tensor dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index = kIgnoreIndex);

// cross_entropy_forward then cross_entropy_backward in one call, for a forward that knows its loss scale: the same
// losses, lse and dlogits bits as the two calls. dlogits may be logits itself (the gradient then replaces the logits in
// their buffer). On CUDA one kernel reads each row once (held in registers; very long rows are read twice, the second
// time partly from L2) and writes its gradient: one pass over the [T, V] logits and one of their gradient.
void cross_entropy_forward_backward(Stream& stream, Tensor losses, Tensor lse, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, double scale, int ignore_index = kIgnoreIndex);

struct LossTotals {
  double sum = 0.0;   // sum of per-token losses, accumulated in f64 in ascending token order
  int64_t count = 0;  // number of targets != ignore_index
};
// Reduces per-token losses into the sum and the count (host values). On CUDA this waits for the stream.
LossTotals cross_entropy_totals(Stream& stream, const Tensor& losses, const Tensor& targets,
                                int ignore_index = kIgnoreIndex);

// The same totals left where the losses are: f64 [2] = {sum, count} on the losses' device (the count is exact in f64
// below 2^53 targets). A training step's micro-batches each make theirs and read_loss_totals reads them at the step's
// end in one copy, so that the host never waits for the GPU inside the step to learn a value only the metrics read.
Tensor cross_entropy_totals_pending(Stream& stream, const Tensor& losses, const Tensor& targets,
                                    int ignore_index = kIgnoreIndex);
// Reads totals made by cross_entropy_totals_pending, in their order, with one wait for the stream (none on the CPU).
std::vector<LossTotals> read_loss_totals(Stream& stream, const std::vector<Tensor>& pending);

}  // namespace moetrain::ops
