// defines: the CPU router reference. One thread per token; every reduction over experts or slots runs in
// ascending order, so a token's routing never depends on the other tokens of the batch.
#include "ops/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename T>
void forward_impl(const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight, const Tensor& logits,
                  const RouterParams& params) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), top_k = params.top_k;
  const T* lp = logits.data<T>();
  T* pp = probs.data<T>();
  int32_t* ip = topk_index.data<int32_t>();
  T* wp = topk_weight.data<T>();
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(experts));
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

      // Descending probability, equal probabilities by ascending expert index: a strict total order, so the
      // selection is unique.
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      int32_t* index = ip + t * top_k;
      T* weight = wp + t * top_k;
      T selected = T(0);
      for (int64_t s = 0; s < top_k; ++s) {
        index[s] = order[static_cast<size_t>(s)];
        weight[s] = p[index[s]];
        selected += weight[s];
      }
      if (params.renormalize) {
        for (int64_t s = 0; s < top_k; ++s) weight[s] /= selected;
      }
    }
  }
}

template <typename T>
void backward_impl(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                   const Tensor& topk_index, const Tensor& topk_weight, const RouterParams& params) {
  const int64_t tokens = probs.size(0), experts = probs.size(1), top_k = params.top_k;
  T* dlp = dlogits.data<T>();
  const T* dwp = dtopk_weight.data<T>();
  const T* dpp = dprobs.defined() ? dprobs.data<T>() : nullptr;
  const T* pp = probs.data<T>();
  const int32_t* ip = topk_index.data<int32_t>();
  const T* wp = topk_weight.data<T>();
#pragma omp parallel
  {
    std::vector<T> dp(static_cast<size_t>(experts));    // gradient on the probabilities of one token
    std::vector<T> dw_raw(static_cast<size_t>(top_k));  // gradient on the selected probabilities before renorm.
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const T* p = pp + t * experts;
      const int32_t* index = ip + t * top_k;
      const T* dw = dwp + t * top_k;
      if (params.renormalize) {
        // w'_k = w_k / S: dw_k = (dw'_k - sum_j dw'_j w'_j) / S.
        const T* w_norm = wp + t * top_k;
        T selected = T(0);
        T inner = T(0);
        for (int64_t s = 0; s < top_k; ++s) {
          selected += p[index[s]];
          inner += dw[s] * w_norm[s];
        }
        for (int64_t s = 0; s < top_k; ++s) dw_raw[static_cast<size_t>(s)] = (dw[s] - inner) / selected;
      } else {
        std::copy(dw, dw + top_k, dw_raw.begin());
      }

      for (int64_t e = 0; e < experts; ++e) dp[static_cast<size_t>(e)] = dpp ? dpp[t * experts + e] : T(0);
      for (int64_t s = 0; s < top_k; ++s) dp[static_cast<size_t>(index[s])] += dw_raw[static_cast<size_t>(s)];

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
                    const RouterParams& params) {
  dispatch_float(logits.dtype(), "router_forward",
                 [&]<typename T>() { forward_impl<T>(probs, topk_index, topk_weight, logits, params); });
}

void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_index, const Tensor& topk_weight, const RouterParams& params) {
  dispatch_float(probs.dtype(), "router_backward", [&]<typename T>() {
    backward_impl<T>(dlogits, dtopk_weight, dprobs, probs, topk_index, topk_weight, params);
  });
}

}  // namespace moetrain::ops::cpu
