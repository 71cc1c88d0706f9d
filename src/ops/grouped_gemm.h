// defines: the expert GEMMs: one linear layer per group of consecutive rows, group g owning rows
// [offsets[g], offsets[g + 1]) and weight w[g] ([N, K], HF's [out, in]). Empty groups are fine.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/gemm.h"  // GradientWrite

namespace moetrain::ops {

// y [R, N] = x [R, K] * w[g]^T per group; w [G, N, K]; offsets i32 [G + 1], 0 .. R.
void grouped_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets);
// dx [R, K] = dy [R, N] * w[g] per group
void grouped_linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w, const Tensor& offsets);
// dw[g] [N, K] += dy_g^T * x_g (rows in ascending order; an empty group adds nothing). With GradientWrite::Overwrite,
// dw[g] = dy_g^T * x_g instead (an empty group's dw[g] becomes 0): the bytes of accumulating onto zeros.
void grouped_linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    GradientWrite write = GradientWrite::Accumulate);

}  // namespace moetrain::ops
