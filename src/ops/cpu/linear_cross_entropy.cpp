// defines: the CPU per-row steps of the chunked linear cross-entropy: online max / sum-exp merge, the final lse and
// losses, and the softmax gradient of one chunk, rows in parallel, each row in one thread in ascending order.
#include "ops/cpu/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

void linear_cross_entropy_chunk_stats(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                      const Tensor& logits_chunk, const Tensor& targets, int64_t begin, bool first,
                                      int ignore_index) {
  dispatch_float(logits_chunk.dtype(), "linear_cross_entropy", [&]<typename T>() {
    const int64_t tokens = logits_chunk.size(0);
    const int64_t n = logits_chunk.size(1);
    const T* x = logits_chunk.data<T>();
    const int32_t* target = targets.data<int32_t>();
    T* m = row_max.data<T>();
    T* s = row_sum.data<T>();
    T* tl = target_logit.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xr = x + t * n;
      T mc = xr[0];
      for (int64_t v = 1; v < n; ++v) mc = std::max(mc, xr[v]);
      T sc = 0;
      for (int64_t v = 0; v < n; ++v) sc += std::exp(xr[v] - mc);
      if (first) {
        m[t] = mc;
        s[t] = sc;
        tl[t] = T(0);
      } else {
        const T merged = std::max(m[t], mc);
        s[t] = s[t] * std::exp(m[t] - merged) + sc * std::exp(mc - merged);
        m[t] = merged;
      }
      const int64_t local = int64_t(target[t]) - begin;
      if (target[t] != ignore_index && local >= 0 && local < n) tl[t] = xr[local];
    }
  });
}

void linear_cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& row_sum,
                                 const Tensor& target_logit, const Tensor& targets, int ignore_index) {
  dispatch_float(lse.dtype(), "linear_cross_entropy", [&]<typename T>() {
    const int64_t tokens = lse.size(0);
    const int32_t* target = targets.data<int32_t>();
    const T* m = row_max.data<T>();
    const T* s = row_sum.data<T>();
    const T* tl = target_logit.data<T>();
    T* loss = losses.data<T>();
    T* l = lse.data<T>();
    for (int64_t t = 0; t < tokens; ++t) {
      l[t] = m[t] + std::log(s[t]);
      loss[t] = target[t] == ignore_index ? T(0) : l[t] - tl[t];
    }
  });
}

void linear_cross_entropy_chunk_gradient(const Tensor& logits_chunk, const Tensor& lse, const Tensor& targets,
                                         int64_t begin, double scale, int ignore_index) {
  dispatch_float(logits_chunk.dtype(), "linear_cross_entropy", [&]<typename T>() {
    const int64_t tokens = logits_chunk.size(0);
    const int64_t n = logits_chunk.size(1);
    T* x = logits_chunk.data<T>();
    const T* l = lse.data<T>();
    const int32_t* target = targets.data<int32_t>();
    const T s = static_cast<T>(scale);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      T* xr = x + t * n;
      if (target[t] == ignore_index) {
        std::fill(xr, xr + n, T(0));
        continue;
      }
      const int64_t local = int64_t(target[t]) - begin;
      for (int64_t v = 0; v < n; ++v) {
        const T p = std::exp(xr[v] - l[t]);
        xr[v] = s * (v == local ? p - T(1) : p);
      }
    }
  });
}

}  // namespace moetrain::ops::cpu
