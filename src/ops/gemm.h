// defines: dense matrix multiply and the linear layer built on it (y = x W^T, W as HF stores it,
// [out_features, in_features]), with its backward split into input and weight gradients.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

enum class Transpose : uint8_t { No, Yes };

// out[M, N] = alpha * op(a) * op(b) + beta * out, op(x) = x or x^T, 2-D contiguous tensors.
// CPU: one float dtype (f32 or f64); each output element is one dot product over K in ascending
// order, so the result is batch-invariant. CUDA (cuBLASLt, f32 accumulation): all f32, or bf16
// operands with a bf16 or f32 output; deterministic for a given shape (the algorithm is fixed per
// shape) but not batch-invariant across M: the exact lanes need their own kernel there.
void gemm(Stream& stream, Tensor out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
          double alpha = 1.0, double beta = 0.0);

// y [M, N] = x [M, K] * w[N, K]^T
void linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w);
// dx [M, K] = dy [M, N] * w [N, K]
void linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w);
// dx [M, K] += dy [M, N] * w [N, K]: the input gradient of one more layer that reads x (a block's q, k and v
// projections) added into dx in the GEMM itself, the sum rounded once (beta = 1). Two exceptions keep other bits:
// under the exact lanes' batch-invariant policy with a bf16 dx (their CUTLASS kernel takes beta = 1 only into f32)
// the product is rounded to bf16, then added by accumulate; on the CPU the sum is that of linear_backward_input
// then accumulate bit for bit (the product, then one rounded addition).
void linear_backward_input_accumulate(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w);
// How a weight gradient op writes dw: adds its sum to what dw holds, or replaces it (the first write of a step, where
// dw would otherwise have to be zeroed first: the overwriting form never reads dw, and nothing has to zero it).
enum class GradientWrite : uint8_t { Accumulate, Overwrite };

// dw [N, K] += dy^T * x  (accumulates, so micro-batches sum into one gradient). With GradientWrite::Overwrite,
// dw = dy^T * x instead, never reading dw (on CUDA beta = 0 with the algorithm of beta = 1; on the CPU zeros, then the
// sum): the bytes of accumulating onto zeros, since a GEMM's sum starts from +0 and so is never -0. M = 0 overwrites
// with zeros.
void linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x,
                            GradientWrite write = GradientWrite::Accumulate);

}  // namespace moetrain::ops
