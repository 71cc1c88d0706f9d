// defines: the CPU cross-entropy kernels: lse = m + log(sum exp(x - m)) with m the row maximum, summed in
// ascending vocabulary order; the backward recomputes softmax = exp(x - lse) from the saved lse.
#include "ops/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                           int ignore_index) {
  dispatch_float(logits.dtype(), "cross_entropy_forward", [&]<typename T>() {
    const int64_t tokens = logits.size(0);
    const int64_t vocab = logits.size(1);
    const T* x = logits.data<T>();
    const int32_t* target = targets.data<int32_t>();
    T* loss = losses.data<T>();
    T* row_lse = lse.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xr = x + t * vocab;
      T m = xr[0];
      for (int64_t v = 1; v < vocab; ++v) m = std::max(m, xr[v]);
      T sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(xr[v] - m);
      const T l = m + std::log(sum);
      row_lse[t] = l;
      loss[t] = target[t] == ignore_index ? T(0) : l - xr[target[t]];
    }
  });
}

void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            double scale, int ignore_index) {
  dispatch_float(logits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    const int64_t tokens = logits.size(0);
    const int64_t vocab = logits.size(1);
    const T* x = logits.data<T>();
    const T* row_lse = lse.data<T>();
    const int32_t* target = targets.data<int32_t>();
    T* dx = dlogits.data<T>();
    const T s = static_cast<T>(scale);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xr = x + t * vocab;
      T* dxr = dx + t * vocab;
      if (target[t] == ignore_index) {
        for (int64_t v = 0; v < vocab; ++v) dxr[v] = T(0);
        continue;
      }
      const T l = row_lse[t];
      const int64_t y = target[t];
      for (int64_t v = 0; v < vocab; ++v) {
        const T p = std::exp(xr[v] - l);
        dxr[v] = s * (v == y ? p - T(1) : p);
      }
    }
  });
}

LossTotals cross_entropy_totals(const Tensor& losses, const Tensor& targets, int ignore_index) {
  LossTotals totals;
  dispatch_float(losses.dtype(), "cross_entropy_totals", [&]<typename T>() {
    const T* loss = losses.data<T>();
    const int32_t* target = targets.data<int32_t>();
    for (int64_t t = 0; t < losses.numel(); ++t) {
      if (target[t] == ignore_index) continue;
      totals.sum += static_cast<double>(loss[t]);
      ++totals.count;
    }
  });
  return totals;
}

}  // namespace moetrain::ops::cpu
