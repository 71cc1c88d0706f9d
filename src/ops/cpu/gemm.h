// defines: the CPU reference matrix multiply (ops/gemm.h): each output element is one dot product over K in
// ascending k, computed in one thread, so a row's result depends neither on the other rows nor on the threads.
#pragma once

#include "core/tensor.h"
#include "ops/gemm.h"

namespace moetrain::ops::cpu {

// out [M, N] = alpha * op(a) * op(b) + beta * out. The arguments are validated by ops::gemm; f32 or f64,
// contiguous, out overlaps neither operand. out is not read when beta == 0.
void gemm(const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
          double alpha, double beta);

}  // namespace moetrain::ops::cpu
