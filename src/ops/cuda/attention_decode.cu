// defines: the CUDA decoding attention (ops/cuda/attention_decode.h).
#include "ops/cuda/attention_decode.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 128;

// Sum or max over the block's kThreads threads in a fixed tree; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) total = kMax ? fmaxf(total, scratch[w]) : total + scratch[w];
  __syncthreads();
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(T* out, float* lse, float* scores, const T* q, const T* k_cache, const T* v_cache,
                  const int32_t* lengths, int64_t nh, int64_t nkv, int64_t hd, int64_t hdv, int64_t capacity,
                  float scale, int window) {
  __shared__ float scratch[kThreads / 32];
  const int64_t pair = blockIdx.x, b = pair / nh, h = pair % nh, g = h / (nh / nkv);
  const int64_t end = lengths[b], begin = window > 0 && end - window > 0 ? end - window : 0;
  const T* qi = q + pair * hd;
  const T* kb = k_cache + b * capacity * nkv * hd;
  const T* vb = v_cache + b * capacity * nkv * hdv;
  float* p = scores + pair * capacity;
  float max = -INFINITY;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    const T* kj = kb + (j * nkv + g) * hd;
    float dot = 0.0f;
    for (int64_t e = 0; e < hd; ++e) dot += load_float(qi + e) * load_float(kj + e);
    p[j] = dot * scale;
    max = fmaxf(max, p[j]);
  }
  max = block_reduce<true>(max, scratch);
  float sum = 0.0f;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    p[j] = expf(p[j] - max);
    sum += p[j];
  }
  sum = block_reduce<false>(sum, scratch);  // its barriers also publish p
  for (int64_t e = threadIdx.x; e < hdv; e += kThreads) {
    float acc = 0.0f;
    for (int64_t j = begin; j < end; ++j) acc += p[j] * load_float(vb + (j * nkv + g) * hdv + e);
    store_float(out + pair * hdv + e, acc / sum);
  }
  if (threadIdx.x == 0) lse[pair] = max + logf(sum);
}

}  // namespace

void attention_decode_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                              const AttentionParams& params) {
  const int64_t rows = q.size(0), nh = q.size(1), hd = q.size(2), capacity = k_cache.size(1), nkv = k_cache.size(2),
                hdv = v_cache.size(3);
  const Tensor scores = Tensor::empty({rows, nh, capacity}, DType::F32, q.device());
  const cudaStream_t cs = static_cast<cudaStream_t>(stream_handle(stream));
  const auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_kernel<T><<<static_cast<unsigned>(rows * nh), kThreads, 0, cs>>>(
        static_cast<T*>(out.raw_data()), static_cast<float*>(lse.raw_data()), static_cast<float*>(scores.raw_data()),
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k_cache.raw_data()),
        static_cast<const T*>(v_cache.raw_data()), static_cast<const int32_t*>(lengths.raw_data()), nh, nkv, hd, hdv,
        capacity, params.softmax_scale, params.sliding_window);
  };
  switch (q.dtype()) {
    case DType::F32: launch(static_cast<float*>(nullptr)); break;
    case DType::BF16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: MT_FAIL("attention_decode_forward (CUDA): expected q in f32 or bf16 but found {}", q.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
