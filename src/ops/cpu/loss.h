// defines: the CPU reference of the cross-entropy (ops/loss.h): one row of logits per token, each row reduced in
// one thread with a max-subtracted log-sum-exp, rows in parallel.
#pragma once

#include "core/tensor.h"
#include "ops/loss.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of ops/loss.h: logits [T, V] in f32 or f64, losses / lse /
// dlogits in the logits' dtype, targets i32 [T] inside [0, V) or equal to ignore_index, all contiguous.
// lse is written for every row, ignored ones included.
void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                           int ignore_index);
// Each element of dlogits is written after reading only the same element of logits, so dlogits may alias logits.
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            double scale, int ignore_index);
LossTotals cross_entropy_totals(const Tensor& losses, const Tensor& targets, int ignore_index);

}  // namespace moetrain::ops::cpu
