// defines: the CUDA cross-entropy kernels, the formulas of ops/cpu/loss.cpp in f32: lse = m + log(sum exp(x - m))
// with m the row maximum, loss = lse - x[target]; dlogits = scale * (exp(x - lse) - onehot). Block reductions are a
// fixed tree: per-thread strided partials, a butterfly inside each warp, then the warp results in a fixed order.
#include "ops/cuda/loss.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kWarps = kCrossEntropyThreads / 32;
constexpr int kTotalsThreads = 1024;
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;  // grid-stride beyond this

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Butterfly inside the warp: every lane ends with the same bits.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces one value per thread of a block of WARPS warps; every thread gets the result. `scratch` holds WARPS
// values; the caller's next use of it must come after a __syncthreads (the one at the start of the next call).
template <int WARPS, typename V, typename Op>
__device__ V block_reduce(V v, V* scratch, Op op) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_reduce(v, op);
  __syncthreads();  // earlier readers of scratch are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  V total = scratch[0];
  for (int w = 1; w < WARPS; ++w) total = op(total, scratch[w]);  // every thread, the same order
  return total;
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Add {
  template <typename V>
  __device__ V operator()(V a, V b) const {
    return a + b;
  }
};

template <typename T>
__global__ void forward_kernel(float* losses, float* lse, const T* logits, const int32_t* targets, int64_t tokens,
                               int64_t vocab, int ignore_index) {
  __shared__ float scratch[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* xr = logits + t * vocab;
    float m = -__int_as_float(0x7f800000);
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) m = fmaxf(m, load_float(xr + v));
    m = block_reduce<kWarps>(m, scratch, Max{});
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(load_float(xr + v) - m);
    sum = block_reduce<kWarps>(sum, scratch, Add{});
    if (threadIdx.x == 0) {
      const float l = m + logf(sum);
      lse[t] = l;
      const int64_t target = targets[t];
      float loss = 0.0f;
      if (target != ignore_index) loss = target >= 0 && target < vocab ? l - load_float(xr + target) : quiet_nan();
      losses[t] = loss;
    }
  }
}

template <typename T>
__global__ void backward_kernel(T* dlogits, const T* logits, const float* lse, const int32_t* targets, int64_t tokens,
                                int64_t vocab, float scale, int ignore_index) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* xr = logits + t * vocab;
    T* dxr = dlogits + t * vocab;
    const int64_t target = targets[t];
    if (target == ignore_index) {
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) store_float(dxr + v, 0.0f);
      continue;
    }
    if (target < 0 || target >= vocab) {  // not validated on the device: poison the row
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) store_float(dxr + v, quiet_nan());
      continue;
    }
    const float l = lse[t];
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float p = expf(load_float(xr + v) - l);
      store_float(dxr + v, scale * (v == target ? p - 1.0f : p));
    }
  }
}

struct Totals {
  double sum;
  long long count;
};

// One block: thread i takes tokens i, i + blockDim, ... in f64, then a fixed tree over the block.
__global__ void totals_kernel(Totals* out, const float* losses, const int32_t* targets, int64_t tokens,
                              int ignore_index) {
  __shared__ double sum_scratch[kTotalsThreads / 32];
  __shared__ long long count_scratch[kTotalsThreads / 32];
  double sum = 0.0;
  long long count = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    if (targets[t] == ignore_index) continue;
    sum += static_cast<double>(losses[t]);
    ++count;
  }
  sum = block_reduce<kTotalsThreads / 32>(sum, sum_scratch, Add{});
  count = block_reduce<kTotalsThreads / 32>(count, count_scratch, Add{});
  if (threadIdx.x == 0) *out = Totals{sum, count};
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

// Calls f(T*) with the logits' element type, f32 or bf16.
template <typename F>
void dispatch_logits(const Tensor& logits, const char* op, F&& f) {
  switch (logits.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: MT_FAIL("{} (CUDA): expected logits in f32 or bf16 but found {}", op, logits.describe());
  }
}

}  // namespace

void cross_entropy_forward(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int ignore_index) {
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_logits(logits, "cross_entropy_forward", [&]<typename T>(T*) {
    forward_kernel<<<row_blocks(tokens), kCrossEntropyThreads, 0, cu_stream>>>(
        static_cast<float*>(losses.raw_data()), static_cast<float*>(lse.raw_data()),
        static_cast<const T*>(logits.raw_data()), static_cast<const int32_t*>(targets.raw_data()), tokens, vocab,
        ignore_index);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_backward(const Stream& stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index) {
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_logits(logits, "cross_entropy_backward", [&]<typename T>(T*) {
    backward_kernel<<<row_blocks(tokens), kCrossEntropyThreads, 0, cu_stream>>>(
        static_cast<T*>(dlogits.raw_data()), static_cast<const T*>(logits.raw_data()),
        static_cast<const float*>(lse.raw_data()), static_cast<const int32_t*>(targets.raw_data()), tokens, vocab,
        static_cast<float>(scale), ignore_index);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

LossTotals cross_entropy_totals(const Stream& stream, const Tensor& losses, const Tensor& targets, int ignore_index) {
  MT_CHECK(losses.dtype() == DType::F32, "cross_entropy_totals (CUDA): expected losses in f32 but found {}",
           losses.describe());
  const int64_t tokens = losses.numel();
  if (tokens == 0) return {};
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  Tensor device_totals = Tensor::empty({static_cast<int64_t>(sizeof(Totals))}, DType::U8, losses.device());
  auto* out = static_cast<Totals*>(device_totals.raw_data());
  totals_kernel<<<1, kTotalsThreads, 0, cu_stream>>>(out, static_cast<const float*>(losses.raw_data()),
                                                     static_cast<const int32_t*>(targets.raw_data()), tokens,
                                                     ignore_index);
  MT_CUDA_CHECK(cudaGetLastError());
  Totals host{};
  MT_CUDA_CHECK(cudaMemcpyAsync(&host, out, sizeof(Totals), cudaMemcpyDeviceToHost, cu_stream));
  MT_CUDA_CHECK(cudaStreamSynchronize(cu_stream));
  return {host.sum, static_cast<int64_t>(host.count)};
}

}  // namespace moetrain::ops::cuda
