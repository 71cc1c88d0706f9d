// defines: the CPU reference of the grouped expert GEMMs (ops/grouped_gemm.h): one linear layer per group of
// consecutive rows, each output element one ascending reduction computed by one thread.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of the same name; f32 or f64.
// y [R, N] = x [R, K] * w[g]^T per group (w [G, N, K], offsets i32 [G + 1]).
void grouped_linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets);
// dx [R, K] = dy [R, N] * w[g] per group (overwrites dx).
void grouped_linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& offsets);
// dw[g] += dy_g^T * x_g: the sum over the group's rows (ascending) is formed first and then added to dw[g].
void grouped_linear_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& offsets);

}  // namespace moetrain::ops::cpu
