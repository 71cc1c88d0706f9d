// defines: the CUDA router kernels (ops/cuda/router.h): one warp per token; softmax in f32, top-k by repeated warp
// arg-max under the strict order (descending probability, ascending expert), renormalisation, and the backward.
#include "ops/cuda/router.h"

#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;  // tokens per block
constexpr unsigned kFullMask = 0xffffffffu;

// Butterfly reductions: every lane ends with the same bits (a + b == b + a in floating point).
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// (p, e) comes before (best_p, best_e): higher probability, or equal probability and lower expert index.
__device__ __forceinline__ bool ranks_before(float p, int e, float best_p, int best_e) {
  return p > best_p || (p == best_p && e < best_e);
}

__global__ void __launch_bounds__(kThreads)
    forward_kernel(float* probs, int32_t* topk_index, float* topk_weight, const float* logits, int64_t tokens,
                   int experts, int top_k, bool renormalize) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (t >= tokens) return;
  const float* l = logits + t * experts;
  float* p = probs + t * experts;

  float max = -INFINITY;
  for (int e = lane; e < experts; e += 32) max = fmaxf(max, l[e]);
  max = warp_max(max);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) sum += expf(l[e] - max);
  sum = warp_sum(sum);
  for (int e = lane; e < experts; e += 32) p[e] = expf(l[e] - max) / sum;

  // Selection s is the first choice after selection s - 1 in the strict order; each lane reads back only the
  // probabilities it wrote itself.
  int32_t* index = topk_index + t * top_k;
  float* weight = topk_weight + t * top_k;
  float prev_p = INFINITY;
  int prev_e = -1;
  float selected = 0.0f;
  for (int s = 0; s < top_k; ++s) {
    float best_p = -INFINITY;
    int best_e = INT_MAX;
    for (int e = lane; e < experts; e += 32) {
      const float pe = p[e];
      if (ranks_before(prev_p, prev_e, pe, e) && ranks_before(pe, e, best_p, best_e)) {
        best_p = pe;
        best_e = e;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_p = __shfl_xor_sync(kFullMask, best_p, offset);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, offset);
      if (ranks_before(other_p, other_e, best_p, best_e)) {
        best_p = other_p;
        best_e = other_e;
      }
    }
    if (lane == 0) {
      index[s] = best_e;
      weight[s] = best_p;
    }
    selected += best_p;
    prev_p = best_p;
    prev_e = best_e;
  }
  if (renormalize && lane == 0) {
    for (int s = 0; s < top_k; ++s) weight[s] /= selected;
  }
}

__global__ void __launch_bounds__(kThreads)
    backward_kernel(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                    const int32_t* topk_index, const float* topk_weight, int64_t tokens, int experts, int top_k,
                    bool renormalize) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (t >= tokens) return;
  const float* p = probs + t * experts;
  const int32_t* index = topk_index + t * top_k;
  const float* dw = dtopk_weight + t * top_k;

  // w'_k = w_k / S: dw_k = (dw'_k - sum_j dw'_j w'_j) / S (every lane computes the same two sums, ascending).
  float selected = 1.0f, inner_w = 0.0f;
  if (renormalize) {
    const float* w_norm = topk_weight + t * top_k;
    selected = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      selected += p[index[s]];
      inner_w += dw[s] * w_norm[s];
    }
  }
  // The gradient on probability e: dprobs plus the selections of e (ascending slot).
  const auto dp_of = [&](int e) {
    float x = dprobs != nullptr ? dprobs[t * experts + e] : 0.0f;
    for (int s = 0; s < top_k; ++s) {
      if (index[s] == e) x += renormalize ? (dw[s] - inner_w) / selected : dw[s];
    }
    return x;
  };

  // Softmax backward: dlogits_e = p_e * (dp_e - sum_e' p_e' dp_e').
  float inner = 0.0f;
  for (int e = lane; e < experts; e += 32) inner += p[e] * dp_of(e);
  inner = warp_sum(inner);
  float* dl = dlogits + t * experts;
  for (int e = lane; e < experts; e += 32) dl[e] = p[e] * (dp_of(e) - inner);
}

unsigned blocks_for(int64_t tokens) { return static_cast<unsigned>((tokens + kWarps - 1) / kWarps); }

void check_f32(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.dtype() == DType::F32, "{}: the CUDA router computes in f32 but {} is {}", op, name, t.describe());
}

}  // namespace

void router_forward(const Stream& stream, const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                    const Tensor& logits, const RouterParams& params) {
  constexpr const char* op = "router_forward";
  check_f32(logits, op, "logits");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  MT_CHECK(experts <= INT_MAX, "{}: E = {} exceeds the CUDA kernel's range", op, experts);
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  forward_kernel<<<blocks_for(tokens), kThreads, 0, s>>>(probs.data<float>(), topk_index.data<int32_t>(),
                                                         topk_weight.data<float>(), logits.data<float>(), tokens,
                                                         static_cast<int>(experts), params.top_k, params.renormalize);
  MT_CUDA_CHECK(cudaGetLastError());
}

void router_backward(const Stream& stream, const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params) {
  constexpr const char* op = "router_backward";
  check_f32(probs, op, "probs");
  const int64_t tokens = probs.size(0), experts = probs.size(1);
  MT_CHECK(experts <= INT_MAX, "{}: E = {} exceeds the CUDA kernel's range", op, experts);
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  backward_kernel<<<blocks_for(tokens), kThreads, 0, s>>>(
      dlogits.data<float>(), dtopk_weight.data<float>(), dprobs.defined() ? dprobs.data<float>() : nullptr,
      probs.data<float>(), topk_index.data<int32_t>(), topk_weight.data<float>(), tokens, static_cast<int>(experts),
      params.top_k, params.renormalize);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
