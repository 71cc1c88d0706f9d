// defines: the CPU router reference. One thread per token; every reduction over experts or slots runs in
// ascending order, so a token's routing never depends on the other tokens of the batch. GPT-OSS's
// top-k-before-softmax ranks the logits themselves and softmaxes the k kept.
#include "ops/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

// Whether the group mask of group-limited top-k can remove an expert (with every group kept it is the identity).
bool masks_groups(const RouterParams& params) { return params.topk_groups < params.num_groups; }

// The group mask of one token: kept[g] = 1 for the topk_groups groups of the largest scores, a group's score being
// the largest probability in it; descending score, equal scores by ascending group index (a strict total order, so
// the kept set is unique). The scratch vectors hold num_groups entries.
template <typename T>
void keep_groups(const T* p, int64_t experts, const RouterParams& params, std::vector<T>& group_score,
                 std::vector<int32_t>& group_order, std::vector<char>& kept) {
  const int64_t size = experts / params.num_groups;
  for (int64_t g = 0; g < params.num_groups; ++g) {
    group_score[static_cast<size_t>(g)] = *std::max_element(p + g * size, p + (g + 1) * size);
  }
  std::iota(group_order.begin(), group_order.end(), 0);
  std::partial_sort(group_order.begin(), group_order.begin() + params.topk_groups, group_order.end(),
                    [&group_score](int32_t a, int32_t b) {
                      const T sa = group_score[static_cast<size_t>(a)], sb = group_score[static_cast<size_t>(b)];
                      return sa > sb || (sa == sb && a < b);
                    });
  std::fill(kept.begin(), kept.end(), char{0});
  for (int64_t i = 0; i < params.topk_groups; ++i) kept[static_cast<size_t>(group_order[static_cast<size_t>(i)])] = 1;
}

// `given`: topk_index holds the selection already (router_forward_given) and only the weights are computed.
template <typename T>
void forward_impl(const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight, const Tensor& logits,
                  const RouterParams& params, bool given) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), top_k = params.top_k;
  const int64_t groups = params.num_groups, group_size = experts / groups;
  const bool masking = masks_groups(params);
  const T scale = static_cast<T>(params.scaling_factor);
  const T* lp = logits.data<T>();
  T* pp = probs.data<T>();
  int32_t* ip = topk_index.data<int32_t>();
  T* wp = topk_weight.data<T>();
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::vector<T> masked(masking ? static_cast<size_t>(experts) : 0);  // the scores after the group mask
    std::vector<T> group_score(static_cast<size_t>(groups));
    std::vector<int32_t> group_order(static_cast<size_t>(groups));
    std::vector<char> kept(static_cast<size_t>(groups));
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const T* l = lp + t * experts;
      T* p = pp + t * experts;
      const T max = *std::max_element(l, l + experts);
      T sum = T(0);
      for (int64_t e = 0; e < experts; ++e) {
        p[e] = std::exp(l[e] - max);
        sum += p[e];
      }
      for (int64_t e = 0; e < experts; ++e) p[e] /= sum;

      int32_t* index = ip + t * top_k;
      T* weight = wp + t * top_k;
      if (params.topk_before_softmax) {
        // GPT-OSS: the top-k of the logits (descending, equal logits by ascending expert index), then a softmax over
        // the k kept, shifted by the largest kept (slot 0 when selected here), its sum in slot order.
        if (!given) {
          std::iota(order.begin(), order.end(), 0);
          std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                            [l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
          for (int64_t s = 0; s < top_k; ++s) index[s] = order[static_cast<size_t>(s)];
        }
        T top = l[index[0]];
        for (int64_t s = 1; s < top_k; ++s) top = std::max(top, l[index[s]]);
        T kept_sum = T(0);
        for (int64_t s = 0; s < top_k; ++s) {
          weight[s] = std::exp(l[index[s]] - top);
          kept_sum += weight[s];
        }
        for (int64_t s = 0; s < top_k; ++s) weight[s] /= kept_sum;
        continue;
      }

      // The scores the selection ranks: the probabilities, or with a group mask the probabilities of the kept
      // groups and 0.0 elsewhere (transformers' masked_fill value).
      const T* score = p;
      if (masking) {
        keep_groups(p, experts, params, group_score, group_order, kept);
        for (int64_t e = 0; e < experts; ++e) {
          masked[static_cast<size_t>(e)] = kept[static_cast<size_t>(e / group_size)] ? p[e] : T(0);
        }
        score = masked.data();
      }

      // Descending score, equal scores by ascending expert index: a strict total order, so the selection is
      // unique.
      if (!given) {
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [score](int32_t a, int32_t b) {
          return score[a] > score[b] || (score[a] == score[b] && a < b);
        });
        for (int64_t s = 0; s < top_k; ++s) index[s] = order[static_cast<size_t>(s)];
      }
      T selected = T(0);
      for (int64_t s = 0; s < top_k; ++s) {
        weight[s] = score[index[s]];
        selected += weight[s];
      }
      if (params.renormalize) {
        for (int64_t s = 0; s < top_k; ++s) weight[s] /= selected;
      }
      // x * 1 == x exactly: without a factor the weights are the unscaled ones bit for bit.
      for (int64_t s = 0; s < top_k; ++s) weight[s] *= scale;
    }
  }
}

template <typename T>
void backward_impl(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                   const Tensor& topk_index, const Tensor& topk_weight, const RouterParams& params) {
  const int64_t tokens = probs.size(0), experts = probs.size(1), top_k = params.top_k;
  const int64_t groups = params.num_groups, group_size = experts / groups;
  const bool masking = masks_groups(params);
  const T scale = static_cast<T>(params.scaling_factor);
  T* dlp = dlogits.data<T>();
  const T* dwp = dtopk_weight.data<T>();
  const T* dpp = dprobs.defined() ? dprobs.data<T>() : nullptr;
  const T* pp = probs.data<T>();
  const int32_t* ip = topk_index.data<int32_t>();
  const T* wp = topk_weight.data<T>();
#pragma omp parallel
  {
    std::vector<T> dp(static_cast<size_t>(experts));              // gradient on the probabilities of one token
    std::vector<T> dw_raw(static_cast<size_t>(top_k));            // gradient on the selected probabilities
    std::vector<char> live(static_cast<size_t>(top_k), char{1});  // the slot's expert is in a kept group
    std::vector<T> group_score(static_cast<size_t>(groups));
    std::vector<int32_t> group_order(static_cast<size_t>(groups));
    std::vector<char> kept(static_cast<size_t>(groups));
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const T* p = pp + t * experts;
      const int32_t* index = ip + t * top_k;
      const T* dw = dwp + t * top_k;
      if (params.topk_before_softmax) {
        // The full softmax's gradient of dprobs (0 without it), then the k-softmax's into the selected logits:
        // w_s (dw_s - sum_s' w_s' dw_s').
        T* dl = dlp + t * experts;
        if (dpp != nullptr) {
          const T* d = dpp + t * experts;
          T inner = T(0);
          for (int64_t e = 0; e < experts; ++e) inner += p[e] * d[e];
          for (int64_t e = 0; e < experts; ++e) dl[e] = p[e] * (d[e] - inner);
        } else {
          for (int64_t e = 0; e < experts; ++e) dl[e] = T(0);
        }
        const T* w = wp + t * top_k;
        T inner_w = T(0);
        for (int64_t s = 0; s < top_k; ++s) inner_w += w[s] * dw[s];
        for (int64_t s = 0; s < top_k; ++s) dl[index[s]] += w[s] * (dw[s] - inner_w);
        continue;
      }
      // A slot whose expert the group mask removed holds the constant 0.0 (forward's masked score): no gradient.
      if (masking) {
        keep_groups(p, experts, params, group_score, group_order, kept);
        for (int64_t s = 0; s < top_k; ++s)
          live[static_cast<size_t>(s)] = kept[static_cast<size_t>(index[s] / group_size)];
      }
      if (params.renormalize) {
        // w_k = c p_k / S over the live slots: dp_k = (c dw_k - sum_j dw_j w_j) / S.
        const T* w = wp + t * top_k;
        T selected = T(0);
        T inner = T(0);
        for (int64_t s = 0; s < top_k; ++s) {
          if (!live[static_cast<size_t>(s)]) continue;
          selected += p[index[s]];
          inner += dw[s] * w[s];
        }
        for (int64_t s = 0; s < top_k; ++s) {
          dw_raw[static_cast<size_t>(s)] = live[static_cast<size_t>(s)] ? (scale * dw[s] - inner) / selected : T(0);
        }
      } else {
        // w_k = c p_k: dp_k = c dw_k.
        for (int64_t s = 0; s < top_k; ++s)
          dw_raw[static_cast<size_t>(s)] = live[static_cast<size_t>(s)] ? scale * dw[s] : T(0);
      }

      for (int64_t e = 0; e < experts; ++e) dp[static_cast<size_t>(e)] = dpp ? dpp[t * experts + e] : T(0);
      for (int64_t s = 0; s < top_k; ++s) {
        if (live[static_cast<size_t>(s)]) dp[static_cast<size_t>(index[s])] += dw_raw[static_cast<size_t>(s)];
      }

      // Softmax backward: dlogits_e = p_e * (dp_e - sum_e' p_e' dp_e').
      T inner = T(0);
      for (int64_t e = 0; e < experts; ++e) inner += p[e] * dp[static_cast<size_t>(e)];
      T* dl = dlp + t * experts;
      for (int64_t e = 0; e < experts; ++e) dl[e] = p[e] * (dp[static_cast<size_t>(e)] - inner);
    }
  }
}

}  // namespace

void router_forward(const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight, const Tensor& logits,
                    const RouterParams& params, bool given) {
  dispatch_float(logits.dtype(), "router_forward",
                 [&]<typename T>() { forward_impl<T>(probs, topk_index, topk_weight, logits, params, given); });
}

void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_index, const Tensor& topk_weight, const RouterParams& params) {
  dispatch_float(probs.dtype(), "router_backward", [&]<typename T>() {
    backward_impl<T>(dlogits, dtopk_weight, dprobs, probs, topk_index, topk_weight, params);
  });
}

}  // namespace moetrain::ops::cpu
