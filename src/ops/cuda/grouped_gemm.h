// defines: the CUDA kernels of the grouped expert GEMMs (ops/grouped_gemm.h). The group offsets stay on the device:
// no host copy, no synchronisation. Shared-memory tiled, f32 accumulation, every output element one reduction in
// ascending order, so results are deterministic and a row's result does not depend on the other rows.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// The arguments are validated by the ops:: functions of the same name (shapes, dtypes, devices; the offsets'
// values cannot be checked without a host copy: the kernels clamp them into [0, R] so that bad offsets give wrong
// numbers, never out-of-bounds accesses). offsets i32 [G + 1] on the device.
// y [R, N] = x [R, K] * w[g]^T per group; x, w and y all f32 or all bf16.
void grouped_linear_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets);
// dx [R, K] = dy [R, N] * w[g] per group (overwrites dx); dy, w and dx all f32 or all bf16.
void grouped_linear_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets);
// dw[g] [N, K] += dy_g^T * x_g, rows in ascending order, the sum formed first and then added to dw[g]; dy and x f32
// or bf16 (one dtype), dw f32. An empty group leaves dw[g] untouched.
void grouped_linear_backward_weight(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const Tensor& offsets);

}  // namespace moetrain::ops::cuda
