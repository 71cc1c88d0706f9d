// defines: the CPU reference of RMSNorm (ops/norm.h) over x viewed as [N, D]: rows in parallel for the forward and
// the input gradient, column blocks in parallel for the weight gradient; every sum runs in one thread, ascending.
#pragma once

#include "core/tensor.h"
#include "ops/norm.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of ops/norm.h; f32 or f64, contiguous, rows = numel / D.
// Every output element is read-then-written at its own index after the row's reduction, so y (dx) may alias x
// (dy) without changing the result.
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params);
// sum = a + b in T, then y, rstd = rmsnorm_forward(sum): one row at a time, with the element code of add_forward and
// rmsnorm_forward, so the bits are theirs. sum may alias a or b, y may alias a or b (not sum).
void add_rmsnorm_forward(const Tensor& sum, const Tensor& y, const Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, const RmsNormParams& params);
void rmsnorm_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                            const RmsNormParams& params);
// dw [D] += sum over rows n (ascending) of dy[n] * x[n] * rstd[n].
void rmsnorm_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& rstd);

}  // namespace moetrain::ops::cpu
