// defines: the CUDA router kernels (ops/cuda/router.h): one warp per token; softmax in f32, the group mask of
// group-limited top-k, top-k by repeated warp arg-max under the strict order (descending score, ascending expert;
// groups likewise), renormalisation, the scaling factor, GPT-OSS's top-k over the logits with a softmax over the k
// kept, and the backward.
#include "ops/cuda/router.h"

#include <climits>
#include <cmath>
#include <cstddef>
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
// The group scores of the group mask live in shared memory, num_groups floats per warp: 32 KiB at this bound.
constexpr int kMaxGroups = 1024;

// Butterfly reductions: every lane ends with the same bits (a + b == b + a in floating point).
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// (p, e) comes before (best_p, best_e): higher probability, or equal probability and lower expert index. The same
// order ranks groups: (group score, group index).
__device__ __forceinline__ bool ranks_before(float p, int e, float best_p, int best_e) {
  return p > best_p || (p == best_p && e < best_e);
}

// Moves the first (p, e) in the strict order to every lane of the warp.
__device__ __forceinline__ void warp_first(float& best_p, int& best_e) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_p = __shfl_xor_sync(kFullMask, best_p, offset);
    const int other_e = __shfl_xor_sync(kFullMask, best_e, offset);
    if (ranks_before(other_p, other_e, best_p, best_e)) {
      best_p = other_p;
      best_e = other_e;
    }
  }
}

// What the kernels need of RouterParams, plus E.
struct Config {
  int experts, top_k;
  int groups, group_size, topk_groups;
  bool masking;  // topk_groups < groups: the group mask removes experts
  bool renormalize;
  float scale;
  bool topk_logits;  // topk_before_softmax: rank the logits, softmax the k kept
  bool given;        // router_forward_given: topk_index holds the selection, only the weights are computed
};

// The group mask of one token (the calling warp's): writes the group scores (the largest probability of each
// group) to group_score (num_groups floats of shared memory, the warp's own), then selects the topk_groups groups
// by repeated warp arg-max under the strict order and returns the last one selected in (last_score, last_group):
// group g is kept iff it ranks at or before it (group_kept). p may have been written by any lane of the warp.
__device__ void select_groups(const float* p, float* group_score, const Config& c, int lane, float& last_score,
                              int& last_group) {
  __syncwarp();  // p's writes by the other lanes are visible after the barrier
  for (int g = lane; g < c.groups; g += 32) {
    float m = -INFINITY;
    for (int e = g * c.group_size; e < (g + 1) * c.group_size; ++e) m = fmaxf(m, p[e]);
    group_score[g] = m;
  }
  __syncwarp();
  float prev_s = INFINITY;
  int prev_g = -1;
  for (int i = 0; i < c.topk_groups; ++i) {
    float best_s = -INFINITY;
    int best_g = INT_MAX;
    for (int g = lane; g < c.groups; g += 32) {
      const float sg = group_score[g];
      if (ranks_before(prev_s, prev_g, sg, g) && ranks_before(sg, g, best_s, best_g)) {
        best_s = sg;
        best_g = g;
      }
    }
    warp_first(best_s, best_g);
    prev_s = best_s;
    prev_g = best_g;
  }
  last_score = prev_s;
  last_group = prev_g;
}

__device__ __forceinline__ bool group_kept(const float* group_score, int g, float last_score, int last_group) {
  return g == last_group || ranks_before(group_score[g], g, last_score, last_group);
}

__global__ void __launch_bounds__(kThreads) forward_kernel(float* probs, int32_t* topk_index, float* topk_weight,
                                                           const float* logits, int64_t tokens, Config c) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (t >= tokens) return;
  const int experts = c.experts;
  const float* l = logits + t * experts;
  float* p = probs + t * experts;

  float max = -INFINITY;
  for (int e = lane; e < experts; e += 32) max = fmaxf(max, l[e]);
  max = warp_max(max);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) sum += expf(l[e] - max);
  sum = warp_sum(sum);
  for (int e = lane; e < experts; e += 32) p[e] = expf(l[e] - max) / sum;

  int32_t* index = topk_index + t * c.top_k;
  float* weight = topk_weight + t * c.top_k;
  if (c.topk_logits) {
    // GPT-OSS: selection s is the first logit after selection s - 1 in the strict order (descending logit, ascending
    // expert); lane 0 keeps the selected logits in weight[] and then turns them into the softmax over the k kept,
    // shifted by the largest (slot 0), its sum in slot order (the CPU's).
    float prev_l = INFINITY;
    int prev_e = -1;
    for (int s = 0; s < c.top_k && !c.given; ++s) {
      float best_l = -INFINITY;
      int best_e = INT_MAX;
      for (int e = lane; e < experts; e += 32) {
        const float le = l[e];
        if (ranks_before(prev_l, prev_e, le, e) && ranks_before(le, e, best_l, best_e)) {
          best_l = le;
          best_e = e;
        }
      }
      warp_first(best_l, best_e);
      if (lane == 0) {
        index[s] = best_e;
        weight[s] = best_l;
      }
      prev_l = best_l;
      prev_e = best_e;
    }
    if (lane == 0) {
      if (c.given) {
        for (int s = 0; s < c.top_k; ++s) weight[s] = l[index[s]];
      }
      // The largest kept logit: slot 0 when selected here (fmaxf of smaller values returns it bit for bit).
      float top = weight[0];
      for (int s = 1; s < c.top_k; ++s) top = fmaxf(top, weight[s]);
      float kept_sum = 0.0f;
      for (int s = 0; s < c.top_k; ++s) {
        weight[s] = expf(weight[s] - top);
        kept_sum += weight[s];
      }
      for (int s = 0; s < c.top_k; ++s) weight[s] /= kept_sum;
    }
    return;
  }

  // The group mask: the scores outside the kept groups are 0.0 (transformers' masked_fill value). Dynamic shared
  // memory holds kWarps slices of num_groups group scores when the mask is on.
  extern __shared__ float shared_group_score[];
  float* group_score = shared_group_score + (threadIdx.x / 32) * c.groups;
  float last_score = 0.0f;
  int last_group = 0;
  if (c.masking) select_groups(p, group_score, c, lane, last_score, last_group);

  // Selection s is the first choice after selection s - 1 in the strict order over the (masked) scores; each lane
  // ranks only the probabilities it wrote itself.
  float prev_p = INFINITY;
  int prev_e = -1;
  float selected = 0.0f;
  if (c.given) {
    // The weights of the given experts: their (masked) scores, summed in slot order. Lane 0 reads probabilities
    // the other lanes wrote.
    __syncwarp();
    if (lane == 0) {
      for (int s = 0; s < c.top_k; ++s) {
        const int e = index[s];
        const float pe = c.masking && !group_kept(group_score, e / c.group_size, last_score, last_group) ? 0.0f : p[e];
        weight[s] = pe;
        selected += pe;
      }
    }
  }
  for (int s = 0; s < c.top_k && !c.given; ++s) {
    float best_p = -INFINITY;
    int best_e = INT_MAX;
    for (int e = lane; e < experts; e += 32) {
      float pe = p[e];
      if (c.masking && !group_kept(group_score, e / c.group_size, last_score, last_group)) pe = 0.0f;
      if (ranks_before(prev_p, prev_e, pe, e) && ranks_before(pe, e, best_p, best_e)) {
        best_p = pe;
        best_e = e;
      }
    }
    warp_first(best_p, best_e);
    if (lane == 0) {
      index[s] = best_e;
      weight[s] = best_p;
    }
    selected += best_p;
    prev_p = best_p;
    prev_e = best_e;
  }
  // Renormalisation, then the factor (x * 1 == x: without a factor the weights are the unscaled ones bit for bit).
  if (lane == 0) {
    for (int s = 0; s < c.top_k; ++s) {
      float w = weight[s];
      if (c.renormalize) w /= selected;
      weight[s] = w * c.scale;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    backward_kernel(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                    const int32_t* topk_index, const float* topk_weight, int64_t tokens, Config c) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (t >= tokens) return;
  const int experts = c.experts, top_k = c.top_k;
  const float* p = probs + t * experts;
  const int32_t* index = topk_index + t * top_k;
  const float* dw = dtopk_weight + t * top_k;
  float* dl = dlogits + t * experts;

  if (c.topk_logits) {
    // The full softmax's gradient of dprobs (0 without it) plus, on a selected expert, the k-softmax's
    // w_s (dw_s - sum_s' w_s' dw_s') (every lane computes that sum, ascending).
    const float* w = topk_weight + t * top_k;
    const float* d = dprobs != nullptr ? dprobs + t * experts : nullptr;
    float inner = 0.0f;
    if (d != nullptr) {
      for (int e = lane; e < experts; e += 32) inner += p[e] * d[e];
      inner = warp_sum(inner);
    }
    float inner_w = 0.0f;
    for (int s = 0; s < top_k; ++s) inner_w += w[s] * dw[s];
    for (int e = lane; e < experts; e += 32) {
      float x = d != nullptr ? p[e] * (d[e] - inner) : 0.0f;
      for (int s = 0; s < top_k; ++s) {
        if (index[s] == e) x += w[s] * (dw[s] - inner_w);
      }
      dl[e] = x;
    }
    return;
  }

  // A slot whose expert the group mask removed holds the constant 0.0 (forward's masked score): no gradient. The
  // mask is recomputed from the forward's probabilities.
  extern __shared__ float shared_group_score[];
  float* group_score = shared_group_score + (threadIdx.x / 32) * c.groups;
  float last_score = 0.0f;
  int last_group = 0;
  if (c.masking) select_groups(p, group_score, c, lane, last_score, last_group);
  const auto live = [&](int s) {
    return !c.masking || group_kept(group_score, index[s] / c.group_size, last_score, last_group);
  };

  // w_k = c p_k / S over the live slots: dp_k = (c dw_k - sum_j dw_j w_j) / S (every lane computes the same two
  // sums, ascending); without renormalisation dp_k = c dw_k.
  float selected = 1.0f, inner_w = 0.0f;
  if (c.renormalize) {
    const float* w = topk_weight + t * top_k;
    selected = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      if (!live(s)) continue;
      selected += p[index[s]];
      inner_w += dw[s] * w[s];
    }
  }
  // The gradient on probability e: dprobs plus the live selections of e (ascending slot).
  const auto dp_of = [&](int e) {
    float x = dprobs != nullptr ? dprobs[t * experts + e] : 0.0f;
    for (int s = 0; s < top_k; ++s) {
      if (index[s] == e && live(s)) x += c.renormalize ? (c.scale * dw[s] - inner_w) / selected : c.scale * dw[s];
    }
    return x;
  };

  // Softmax backward: dlogits_e = p_e * (dp_e - sum_e' p_e' dp_e').
  float inner = 0.0f;
  for (int e = lane; e < experts; e += 32) inner += p[e] * dp_of(e);
  inner = warp_sum(inner);
  for (int e = lane; e < experts; e += 32) dl[e] = p[e] * (dp_of(e) - inner);
}

unsigned blocks_for(int64_t tokens) { return static_cast<unsigned>((tokens + kWarps - 1) / kWarps); }

void check_f32(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.dtype() == DType::F32, "{}: the CUDA router computes in f32 but {} is {}", op, name, t.describe());
}

Config make_config(int64_t experts, const RouterParams& params, const char* op) {
  MT_CHECK(experts <= INT_MAX, "{}: E = {} exceeds the CUDA kernel's range", op, experts);
  MT_CHECK(params.num_groups <= kMaxGroups,
           "{}: num_groups ({}) exceeds the CUDA kernel's {} (its group scores live in shared memory)", op,
           params.num_groups, kMaxGroups);
  Config c{};
  c.experts = static_cast<int>(experts);
  c.top_k = params.top_k;
  c.groups = params.num_groups;
  c.group_size = c.experts / c.groups;
  c.topk_groups = params.topk_groups;
  c.masking = params.topk_groups < params.num_groups;
  c.renormalize = params.renormalize;
  c.scale = static_cast<float>(params.scaling_factor);
  c.topk_logits = params.topk_before_softmax;
  return c;
}

size_t shared_bytes(const Config& c) {
  return c.masking ? static_cast<size_t>(kWarps) * static_cast<size_t>(c.groups) * sizeof(float) : 0;
}

}  // namespace

void router_forward(const Stream& stream, const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                    const Tensor& logits, const RouterParams& params, bool given) {
  constexpr const char* op = "router_forward";
  check_f32(logits, op, "logits");
  const int64_t tokens = logits.size(0);
  Config c = make_config(logits.size(1), params, op);
  c.given = given;
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  forward_kernel<<<blocks_for(tokens), kThreads, shared_bytes(c), s>>>(
      probs.data<float>(), topk_index.data<int32_t>(), topk_weight.data<float>(), logits.data<float>(), tokens, c);
  MT_CUDA_CHECK(cudaGetLastError());
}

void router_backward(const Stream& stream, const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params) {
  constexpr const char* op = "router_backward";
  check_f32(probs, op, "probs");
  const int64_t tokens = probs.size(0);
  const Config c = make_config(probs.size(1), params, op);
  if (tokens == 0) return;
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  backward_kernel<<<blocks_for(tokens), kThreads, shared_bytes(c), s>>>(
      dlogits.data<float>(), dtopk_weight.data<float>(), dprobs.defined() ? dprobs.data<float>() : nullptr,
      probs.data<float>(), topk_index.data<int32_t>(), topk_weight.data<float>(), tokens, c);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
