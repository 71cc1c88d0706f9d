// defines: the CUDA kernels of the chunked linear cross-entropy: per-row online max / sum-exp merge over one logits
// chunk, the final lse / losses, and the in-place softmax gradient of one chunk. Block reductions are a fixed tree
// (strided per-thread partials, a butterfly in each warp, the warp results in order), so results are deterministic
// and a row's values do not depend on the other rows.
#include "ops/cuda/linear_cross_entropy.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kFinishThreads = 256;
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;  // grid-stride beyond this

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Every thread of the block gets the same result; scratch holds kWarps values.
template <typename Op>
__device__ float block_reduce(float v, float* scratch, Op op) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_reduce(v, op);
  __syncthreads();  // earlier readers of scratch are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = op(total, scratch[w]);
  return total;
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};

template <typename T>
__global__ void chunk_stats_kernel(float* row_max, float* row_sum, float* target_logit, const T* logits,
                                   const int32_t* targets, int64_t tokens, int64_t n, int64_t begin, bool first,
                                   int ignore_index) {
  __shared__ float scratch[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* xr = logits + t * n;
    float mc = -__int_as_float(0x7f800000);
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) mc = fmaxf(mc, load_float(xr + v));
    mc = block_reduce(mc, scratch, Max{});
    float sc = 0.0f;
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) sc += expf(load_float(xr + v) - mc);
    sc = block_reduce(sc, scratch, Add{});
    if (threadIdx.x == 0) {
      if (first) {
        row_max[t] = mc;
        row_sum[t] = sc;
        target_logit[t] = quiet_nan();  // stays NaN for an out-of-range target
      } else {
        const float m = row_max[t];
        const float merged = fmaxf(m, mc);
        row_sum[t] = row_sum[t] * expf(m - merged) + sc * expf(mc - merged);
        row_max[t] = merged;
      }
      const int64_t target = targets[t];
      const int64_t local = target - begin;
      if (target != ignore_index && local >= 0 && local < n) target_logit[t] = load_float(xr + local);
    }
  }
}

__global__ void finish_kernel(float* losses, float* lse, const float* row_max, const float* row_sum,
                              const float* target_logit, const int32_t* targets, int64_t tokens, int ignore_index) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float l = row_max[t] + logf(row_sum[t]);
  lse[t] = l;
  losses[t] = targets[t] == ignore_index ? 0.0f : l - target_logit[t];
}

template <typename T>
__global__ void chunk_gradient_kernel(T* logits, const float* lse, const int32_t* targets, int64_t tokens, int64_t n,
                                      int64_t begin, int64_t vocab, float scale, int ignore_index) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    T* xr = logits + t * n;
    const int64_t target = targets[t];
    if (target == ignore_index) {
      for (int64_t v = threadIdx.x; v < n; v += blockDim.x) store_float(xr + v, 0.0f);
      continue;
    }
    if (target < 0 || target >= vocab) {  // not validated on the device: poison the row
      for (int64_t v = threadIdx.x; v < n; v += blockDim.x) store_float(xr + v, quiet_nan());
      continue;
    }
    const float l = lse[t];
    const int64_t local = target - begin;
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) {
      const float p = expf(load_float(xr + v) - l);
      store_float(xr + v, scale * (v == local ? p - 1.0f : p));
    }
  }
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

// Calls f(T*) with the chunk's element type, f32 or bf16.
template <typename F>
void dispatch_chunk(const Tensor& chunk, F&& f) {
  switch (chunk.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default:
      MT_FAIL("linear_cross_entropy (CUDA): expected a logits chunk in f32 or bf16 but found {}", chunk.describe());
  }
}

}  // namespace

void linear_cross_entropy_chunk_stats(const Stream& stream, const Tensor& row_max, const Tensor& row_sum,
                                      const Tensor& target_logit, const Tensor& logits_chunk, const Tensor& targets,
                                      int64_t begin, bool first, int ignore_index) {
  const int64_t tokens = logits_chunk.size(0);
  const int64_t n = logits_chunk.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_chunk(logits_chunk, [&]<typename T>(T*) {
    chunk_stats_kernel<<<row_blocks(tokens), kThreads, 0, cu_stream>>>(
        static_cast<float*>(row_max.raw_data()), static_cast<float*>(row_sum.raw_data()),
        static_cast<float*>(target_logit.raw_data()), static_cast<const T*>(logits_chunk.raw_data()),
        static_cast<const int32_t*>(targets.raw_data()), tokens, n, begin, first, ignore_index);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void linear_cross_entropy_finish(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& row_max,
                                 const Tensor& row_sum, const Tensor& target_logit, const Tensor& targets,
                                 int ignore_index) {
  const int64_t tokens = lse.size(0);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const auto blocks = static_cast<unsigned>((tokens + kFinishThreads - 1) / kFinishThreads);
  finish_kernel<<<blocks, kFinishThreads, 0, cu_stream>>>(
      static_cast<float*>(losses.raw_data()), static_cast<float*>(lse.raw_data()),
      static_cast<const float*>(row_max.raw_data()), static_cast<const float*>(row_sum.raw_data()),
      static_cast<const float*>(target_logit.raw_data()), static_cast<const int32_t*>(targets.raw_data()), tokens,
      ignore_index);
  MT_CUDA_CHECK(cudaGetLastError());
}

void linear_cross_entropy_chunk_gradient(const Stream& stream, const Tensor& logits_chunk, const Tensor& lse,
                                         const Tensor& targets, int64_t begin, int64_t vocab, double scale,
                                         int ignore_index) {
  const int64_t tokens = logits_chunk.size(0);
  const int64_t n = logits_chunk.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_chunk(logits_chunk, [&]<typename T>(T*) {
    chunk_gradient_kernel<<<row_blocks(tokens), kThreads, 0, cu_stream>>>(
        static_cast<T*>(logits_chunk.raw_data()), static_cast<const float*>(lse.raw_data()),
        static_cast<const int32_t*>(targets.raw_data()), tokens, n, begin, vocab, static_cast<float>(scale),
        ignore_index);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
