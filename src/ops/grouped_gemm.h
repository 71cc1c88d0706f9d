// defines: the expert GEMMs: one linear layer per group of consecutive rows, group g owning rows
// [offsets[g], offsets[g + 1]) and weight w[g] ([N, K], HF's [out, in]). Empty groups are fine.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/gemm.h"     // GradientWrite
#include "ops/permute.h"  // RoutingPlan

namespace moetrain::ops {

// y [R, N] = x [R, K] * w[g]^T per group; w [G, N, K]; offsets i32 [G + 1], 0 .. R.
void grouped_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets);
// y [T*K, N] = x [T, H] permuted by the plan (permute_forward's rows: row r holds token row_choice[r] / K) times w[g]^T
// per expert group (the plan's expert_offsets; w [E, N, H]). The bytes of permute_forward followed by
// grouped_linear_forward; on CUDA in bf16 the rows are gathered inside the GEMM's loads, without the [T*K, H] copy
// (ops/cuda/cutlass_gather_rows.cuh; outside the exact lanes, whose policy keeps the two-op form).
void grouped_linear_forward_gathered(Stream& stream, Tensor y, const Tensor& x, const RoutingPlan& plan,
                                     const Tensor& w);
// dx [R, K] = dy [R, N] * w[g] per group
void grouped_linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w, const Tensor& offsets);
// dw[g] [N, K] += dy_g^T * x_g (rows in ascending order; an empty group adds nothing). With GradientWrite::Overwrite,
// dw[g] = dy_g^T * x_g instead (an empty group's dw[g] becomes 0): the bytes of accumulating onto zeros.
void grouped_linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    GradientWrite write = GradientWrite::Accumulate);

}  // namespace moetrain::ops
