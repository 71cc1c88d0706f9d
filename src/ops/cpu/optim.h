// defines: the CPU reference of the optimizer math (ops/optim.h): the AdamW update element by element, and the
// f64 sum of squares behind the global gradient norm.
#pragma once

#include "core/tensor.h"
#include "ops/optim.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::adamw_step: same shape and dtype (f32 or f64), contiguous; or, under f32
// params, both moments in bf16. The scalars are formed in double as PyTorch forms them in Python, then each element
// is updated in T with PyTorch's operation order (torch.optim.AdamW, single-tensor and foreach paths); bf16 moments
// are widened when read and rounded to nearest even when written, after the param's update has used them.
void adamw_step(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                const AdamWParams& params);
// sum of x^2 over the elements in ascending order, accumulated in f64 in one thread (f32 or f64 x).
double sum_of_squares(const Tensor& x);

}  // namespace moetrain::ops::cpu
