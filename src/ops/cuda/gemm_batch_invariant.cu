// defines: the exact lanes' dense GEMM (ops/cuda/gemm_batch_invariant.h): the choice between CUTLASS and the tiled
// CUDA-core kernel, the three f32-output CUTLASS instantiations, and the tiled kernel.
#include "ops/cuda/gemm_batch_invariant.h"

#include <cstdint>

#include "ops/cuda/cutlass_grouped.cuh"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/grouped_gemm_cutlass.h"

namespace moetrain::ops::cuda {

namespace {

using namespace cutlass_grouped;

// The tiled kernel: a block computes a kTile x kTile tile of out, each of its 16 x 16 threads kTile / 16 x kTile / 16
// elements (rows ty + 16 i, columns tx + 16 j); a and op(b) pass through shared memory in slices of kSlice along K,
// as f32.
constexpr int kTile = 64;
constexpr int kSlice = 16;
constexpr int kSide = 16;  // threads per block side
constexpr int kPer = kTile / kSide;

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kSide* kSide)
    tiled_gemm_kernel(TOut* __restrict__ out, const TIn* __restrict__ a, const TIn* __restrict__ b, int64_t m,
                      int64_t n, int64_t k, bool transpose_b, float alpha, float beta) {
  __shared__ float a_s[kTile][kSlice + 1];
  __shared__ float b_s[kSlice][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int tid = ty * kSide + tx;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  float acc[kPer][kPer] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
    for (int idx = tid; idx < kTile * kSlice; idx += kSide * kSide) {
      const int r = idx / kSlice, kk = idx % kSlice;
      const int64_t row = row0 + r, kc = k0 + kk;
      a_s[r][kk] = row < m && kc < k ? load_float(a + row * k + kc) : 0.0f;
    }
    for (int idx = tid; idx < kTile * kSlice; idx += kSide * kSide) {
      const int kk = idx / kTile, c = idx % kTile;
      const int64_t col = col0 + c, kc = k0 + kk;
      float value = 0.0f;
      if (col < n && kc < k) value = load_float(transpose_b ? b + col * k + kc : b + kc * n + col);
      b_s[kk][c] = value;
    }
    __syncthreads();
    // Slices past K hold zeros; they are skipped, so every element's sum has exactly K terms in ascending order.
    const int valid = static_cast<int>(k - k0 < kSlice ? k - k0 : kSlice);
    for (int kk = 0; kk < valid; ++kk) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const float av = a_s[ty + kSide * i][kk];
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[i][j] = __fmaf_rn(av, b_s[kk][tx + kSide * j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t row = row0 + ty + kSide * i;
    if (row >= m) continue;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t col = col0 + tx + kSide * j;
      if (col >= n) continue;
      TOut* p = out + row * n + col;
      float value = __fmul_rn(alpha, acc[i][j]);
      if (beta != 0.0f) value = __fadd_rn(value, __fmul_rn(beta, load_float(p)));
      store_float(p, value);
    }
  }
}

template <typename TIn, typename TOut>
void launch_tiled(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b, Transpose transpose_b,
                  float alpha, float beta) {
  const int64_t m = out.size(0), n = out.size(1), k = a.size(1);
  const int64_t row_tiles = (m + kTile - 1) / kTile, col_tiles = (n + kTile - 1) / kTile;
  MT_CHECK(row_tiles <= 65535 && col_tiles <= INT_MAX,
           "gemm (batch-invariant): out [{}, {}] needs {} x {} tiles of {}, more than the grid holds", m, n, row_tiles,
           col_tiles, kTile);
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  tiled_gemm_kernel<TIn, TOut><<<grid, dim3(kSide, kSide), 0, static_cast<cudaStream_t>(stream_handle(stream))>>>(
      static_cast<TOut*>(out.raw_data()), static_cast<const TIn*>(a.raw_data()), static_cast<const TIn*>(b.raw_data()),
      m, n, k, transpose_b == Transpose::Yes, alpha, beta);
  MT_CUDA_CHECK(cudaGetLastError());
}

void run_tiled(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b, Transpose transpose_b,
               float alpha, float beta) {
  const bool bf16_in = a.dtype() == DType::BF16, bf16_out = out.dtype() == DType::BF16;
  if (bf16_in && bf16_out)
    return launch_tiled<__nv_bfloat16, __nv_bfloat16>(stream, out, a, b, transpose_b, alpha, beta);
  if (bf16_in) return launch_tiled<__nv_bfloat16, float>(stream, out, a, b, transpose_b, alpha, beta);
  MT_CHECK(!bf16_out, "gemm (batch-invariant): f32 operands with a bf16 output ({}) are not a gemm dtype combination",
           out.describe());
  launch_tiled<float, float>(stream, out, a, b, transpose_b, alpha, beta);
}

void run_cutlass(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b, Transpose transpose_b,
                 double beta) {
  const int64_t rows = a.size(0);
  const bool forward = transpose_b == Transpose::Yes;
  // b as a linear layer's weight [N_w, K_w]: forward reads it as w [N, K]; the input gradient as w [K_dy, N_dx].
  const int64_t w_rows = b.size(0), w_cols = b.size(1);
  if (out.dtype() == DType::BF16) {
    if (forward) return dense_linear_forward_cutlass(stream, out, a, b);
    return dense_linear_backward_input_cutlass(stream, out, a, b);
  }
  if (forward) {
    return run_grouped<ForwardF32Gemm, OpKind::kForward>(stream, a, b, out, nullptr, 1, rows, w_rows, w_cols,
                                                         "linear_forward");
  }
  if (beta != 0.0) {
    return run_grouped<BackwardInputF32AccumulateGemm, OpKind::kBackwardInputAccumulate>(
        stream, a, b, out, nullptr, 1, rows, w_rows, w_cols, "linear_backward_input");
  }
  run_grouped<BackwardInputF32Gemm, OpKind::kBackwardInput>(stream, a, b, out, nullptr, 1, rows, w_rows, w_cols,
                                                            "linear_backward_input");
}

}  // namespace

bool batch_invariant_gemm_uses_cutlass(DType operands, DType out, int64_t n, int64_t k, Transpose transpose_b,
                                       double alpha, double beta) {
  const bool aligned_shape = n > 0 && k > 0 && n % kCutlassGroupedAlignment == 0 && k % kCutlassGroupedAlignment == 0 &&
                             n <= INT_MAX && k <= INT_MAX;
  if (operands != DType::BF16 || !aligned_shape || alpha != 1.0) return false;
  if (beta == 0.0) return out == DType::BF16 || out == DType::F32;
  return beta == 1.0 && out == DType::F32 && transpose_b == Transpose::No;
}

void gemm_batch_invariant(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b,
                          Transpose transpose_b, double alpha, double beta) {
  const int64_t n = out.size(1), k = a.size(1);
  if (!batch_invariant_gemm_uses_cutlass(a.dtype(), out.dtype(), n, k, transpose_b, alpha, beta)) {
    run_tiled(stream, out, a, b, transpose_b, static_cast<float>(alpha), static_cast<float>(beta));
    return;
  }
  for (const Tensor* t : {&out, &a, &b}) {
    MT_CHECK(aligned16(*t),
             "gemm (batch-invariant): [{}, {}] x [{}, {}] runs on CUTLASS, which needs 16-byte aligned tensors, but {} "
             "starts at {}; the exact lanes do not send it to another kernel, whose bytes differ",
             a.size(0), k, k, n, t->describe(), t->raw_data());
  }
  MT_CHECK(a.size(0) <= INT_MAX, "gemm (batch-invariant): M = {} exceeds CUTLASS's 32-bit range", a.size(0));
  run_cutlass(stream, out, a, b, transpose_b, beta);
}

}  // namespace moetrain::ops::cuda
