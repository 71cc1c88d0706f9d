// defines: dense matrix multiply and the linear layer built on it (y = x W^T, W as HF stores it,
// [out_features, in_features]), with its backward split into input and weight gradients.
#pragma once

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
// dw [N, K] += dy^T * x  (accumulates, so micro-batches sum into one gradient)
void linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x);

}  // namespace moetrain::ops
