// defines: the CPU attention-sink reference. With a = lse (the log-sum-exp over the visible keys) and s = the sink
// logit, the sinked softmax has the denominator exp(a) + exp(s), so every probability (and out, a weighted sum with a
// zero sink value) scales by exp(a) / (exp(a) + exp(s)) = sigmoid(a - s), and the new lse is logaddexp(a, s). Both are
// written in the forms that never overflow: the exponent is always <= 0.
#include "ops/cpu/attention_sinks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename T>
void forward_impl(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  const int64_t tokens = out.size(0), nh = out.size(1), hdv = out.size(2);
  T* op = out.data<T>();
  T* lp = lse.data<T>();
  const T* sp = sinks.data<T>();
  const int64_t pairs = tokens * nh;
#pragma omp parallel for schedule(static)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const T a = lp[pair], s = sp[pair % nh];
    const T d = a - s;  // +inf for a sink of -inf: the scale is 1 and lse is unchanged
    const T e = std::exp(-std::abs(d));
    const T scale = d >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
    T* oi = op + pair * hdv;
    for (int64_t c = 0; c < hdv; ++c) oi[c] *= scale;
    lp[pair] = std::max(a, s) + std::log1p(e);
  }
}

template <typename T>
void backward_impl(const Tensor& dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse,
                   const Tensor& sinks) {
  const int64_t tokens = out.size(0), nh = out.size(1), hdv = out.size(2);
  const T* dop = dout.data<T>();
  const T* op = out.data<T>();
  const T* lp = lse.data<T>();
  const T* sp = sinks.data<T>();
  T* dsp = dsinks.data<T>();
  // One head per iteration; its tokens in ascending order.
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < nh; ++h) {
    T sum = T(0);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pair = t * nh + h;
      T dot = T(0);
      for (int64_t c = 0; c < hdv; ++c) dot += dop[pair * hdv + c] * op[pair * hdv + c];
      sum += std::exp(sp[h] - lp[pair]) * dot;
    }
    dsp[h] -= sum;
  }
}

}  // namespace

void attention_sinks_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  dispatch_float(out.dtype(), "attention_sinks_forward", [&]<typename T>() { forward_impl<T>(out, lse, sinks); });
}

void attention_sinks_backward(const Tensor& dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& sinks) {
  dispatch_float(out.dtype(), "attention_sinks_backward",
                 [&]<typename T>() { backward_impl<T>(dsinks, dout, out, lse, sinks); });
}

}  // namespace moetrain::ops::cpu
