// defines: the bias terms of linear layers that carry one (GPT-OSS's router, attention and experts): a bias added to
// every row, or per group of consecutive rows (the expert banks, grouped as in ops/grouped_gemm.h), and the bias
// gradients, column sums whose rows are summed in ascending order.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// y [R, N] += bias [N] on every row. y: f32 or f64 on the CPU, f32 or bf16 on CUDA; bias f32 or y's dtype.
void bias_add(Stream& stream, Tensor y, const Tensor& bias);
// dbias [N] += the column sums of dy [R, N], rows summed in ascending order (the sum is formed, then added).
// dbias is f32, or f64 with f64 dy (the CPU's gradient checks).
void bias_backward(Stream& stream, Tensor dbias, const Tensor& dy);

// y [M, N] = x [M, K] w [N, K]^T + bias [N] (undefined: no bias), rounded once: under bf16 the product is formed in
// f32, the bias added there and the sum rounded to bf16, as cuBLAS's bias epilogue under transformers' autocast
// rounds it (a bias added to the rounded product would round twice). Operands as ops::linear_forward's.
void biased_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias);

// Rows [offsets[g], offsets[g + 1]) of y [R, N] += bias[g] (bias [G, N], f32 or y's dtype); offsets i32 [G + 1] from
// 0 to R on the stream's device. Empty groups are fine.
void grouped_bias_add(Stream& stream, Tensor y, const Tensor& bias, const Tensor& offsets);
// dbias [G, N] += the column sums of each group's rows of dy [R, N]; an empty group adds nothing. dbias is f32, or
// f64 with f64 dy.
void grouped_bias_backward(Stream& stream, Tensor dbias, const Tensor& dy, const Tensor& offsets);

}  // namespace moetrain::ops
