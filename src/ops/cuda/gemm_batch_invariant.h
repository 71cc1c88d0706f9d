// defines: the exact lanes' dense GEMM (KernelPolicy::BatchInvariant, core/device.h): out [M, N] = alpha * a * op(b) +
// beta * out, where the M rows of a are the batch (a linear layer's forward and input gradient). The kernel is chosen
// by (N, K, op(b), dtypes, alpha, beta) alone, never by M, and computes every output element as one reduction over K
// in an order fixed by K, so the bytes of row r depend on row r of a, on b and on that choice only: not on M, on r, or
// on the other rows.
//   - CUTLASS (ops/cuda/cutlass_grouped.cuh, one group of all rows; one tile configuration, no split-K): bf16 a and b,
//     N and K positive multiples of 8, alpha = 1, and beta = 0 (bf16 or f32 out) or beta = 1 (f32 out, op(b) = b).
//     Every tensor must then start on a 16-byte boundary: one that does not is refused, never sent to the other kernel,
//     whose bytes differ.
//   - Otherwise a tiled kernel on the CUDA cores: f32 accumulation with one fused multiply-add per k in ascending
//   order,
//     then alpha * sum + beta * out.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/gemm.h"

namespace moetrain::ops::cuda {

// Whether CUTLASS runs this problem (the first rule above); a function of the shapes, dtypes and scalars only.
bool batch_invariant_gemm_uses_cutlass(DType operands, DType out, int64_t n, int64_t k, Transpose transpose_b,
                                       double alpha, double beta);

// Arguments validated by ops::gemm (2-D contiguous, matching dimensions, a and b of one dtype, f32 or bf16, out f32 or
// bf16, K > 0, M and N > 0).
void gemm_batch_invariant(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b,
                          Transpose transpose_b, double alpha, double beta);

}  // namespace moetrain::ops::cuda
