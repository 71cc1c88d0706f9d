// defines: the CPU Gated DeltaNet kernels, written as transformers 5.17's Qwen3.5 code computes (causal_conv1d_fn,
// l2norm, the gates of Qwen3_5GatedDeltaNet.forward, torch_recurrent_gated_delta_rule, Qwen3_5RMSNormGated), with
// documents of cu_seqlens kept apart, and their manual backward.
#include "ops/cpu/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// silu'(x) = s * (1 + x * (1 - s)), s = sigmoid(x).
template <typename T>
T silu_grad(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

// torch.nn.functional.softplus (beta 1, threshold 20): linear above the threshold.
template <typename T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

// Its derivative as torch's backward writes it: 1 above the threshold, else z / (z + 1) with z = exp(x).
template <typename T>
T softplus_grad(T x) {
  if (x > T(20)) return T(1);
  const T z = std::exp(x);
  return z / (z + T(1));
}

// [start, end) of each token's document.
struct DocSpans {
  std::vector<int64_t> start, end;
};

DocSpans doc_spans(const Tensor& cu_seqlens, int64_t tokens) {
  DocSpans spans{std::vector<int64_t>(static_cast<size_t>(tokens)), std::vector<int64_t>(static_cast<size_t>(tokens))};
  const int32_t* cu = cu_seqlens.data<int32_t>();
  for (int64_t d = 0; d + 1 < cu_seqlens.numel(); ++d) {
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      spans.start[static_cast<size_t>(t)] = cu[d];
      spans.end[static_cast<size_t>(t)] = cu[d + 1];
    }
  }
  return spans;
}

// The conv's pre-activation at (t, c): the taps that fall before t's document start are skipped (zero rows).
template <typename T>
T conv_pre(const T* x, const T* w, int64_t t, int64_t c, int64_t channels, int64_t kernel, int64_t start) {
  T sum = 0;
  for (int64_t j = 0; j < kernel; ++j) {
    const int64_t src = t - (kernel - 1) + j;
    if (src >= start) sum += w[c * kernel + j] * x[src * channels + c];
  }
  return sum;
}

// One (document, value head) of the rule's forward, or the recomputation inside the backward: the state update of
// token t (decay, u = beta * (v - S^T k), S += k u^T) on S [dk, dv] row-major; u [dv] receives u.
template <typename T>
void rule_step(T* S, T* u, const T* kt, const T* vt, T gt, T bt, int64_t dk, int64_t dv) {
  const T decay = std::exp(gt);
  for (int64_t e = 0; e < dk * dv; ++e) S[e] *= decay;
  for (int64_t j = 0; j < dv; ++j) {
    T kv = 0;
    for (int64_t i = 0; i < dk; ++i) kv += S[i * dv + j] * kt[i];
    u[j] = (vt[j] - kv) * bt;
  }
  for (int64_t i = 0; i < dk; ++i) {
    for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * u[j];
  }
}

struct RuleDims {
  int64_t tokens, hk, hv, dk, dv, group;
};

RuleDims rule_dims(const Tensor& q, const Tensor& v) {
  RuleDims d{q.size(0), q.size(1), v.size(1), q.size(2), v.size(2), 0};
  d.group = d.hv / d.hk;
  return d;
}

// One token of one (sequence, value head): the state update, then out_t = S^T (scale q_t). The forward and the
// decoding step both run it, so a token's bytes are the same whichever computed it.
template <typename T>
void rule_token(T* S, T* u, T* qs, const T* qt, const T* kt, const T* vt, T gt, T bt, T* ot, const RuleDims& d,
                T scale) {
  rule_step(S, u, kt, vt, gt, bt, d.dk, d.dv);
  for (int64_t i = 0; i < d.dk; ++i) qs[i] = qt[i] * scale;
  for (int64_t j = 0; j < d.dv; ++j) {
    T sum = 0;
    for (int64_t i = 0; i < d.dk; ++i) sum += S[i * d.dv + j] * qs[i];
    ot[j] = sum;
  }
}

// final_state (null: not kept) [D, Hv, dk, dv] receives each (document, value head)'s state after its last token.
template <typename T>
void rule_forward(T* out, const T* q, const T* k, const T* v, const T* g, const T* beta, const int32_t* cu,
                  int64_t docs, const RuleDims& d, T scale, T* final_state) {
  const int64_t items = docs * d.hv;
#pragma omp parallel for schedule(dynamic)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t doc = item / d.hv, h = item % d.hv, hk = h / d.group;
    std::vector<T> S(static_cast<size_t>(d.dk * d.dv), T(0)), u(static_cast<size_t>(d.dv)),
        qs(static_cast<size_t>(d.dk));
    for (int64_t t = cu[doc]; t < cu[doc + 1]; ++t) {
      rule_token(S.data(), u.data(), qs.data(), q + (t * d.hk + hk) * d.dk, k + (t * d.hk + hk) * d.dk,
                 v + (t * d.hv + h) * d.dv, g[t * d.hv + h], beta[t * d.hv + h], out + (t * d.hv + h) * d.dv, d, scale);
    }
    if (final_state != nullptr) std::copy(S.begin(), S.end(), final_state + item * d.dk * d.dv);
  }
}

// The reverse scan of one (document, value head). dS is dL/dS_t; per token, going back:
//   dq_t = scale * S_t dout_t;  dS += (scale q_t) dout_t^T;  du = dS^T k_t;  dv_t = beta_t du;
//   dbeta_t = du . (v_t - St^T k_t);  dk_t = dS u_t - St dv_t;  dS -= k_t dv_t^T;  dg_t = <St, dS>;  dS *= exp(g_t)
// where St = exp(g_t) S_{t-1} (the decayed state before the update) and S_t = St + k_t u_t^T. dq_t and dk_t of this
// value head go to dq_heads / dk_heads [T, Hv, dk], summed over the group afterwards.
template <typename T>
void rule_backward_item(T* dq_heads, T* dk_heads, T* dv, T* dg, T* dbeta, const T* dout, const T* q, const T* k,
                        const T* v, const T* g, const T* beta, int64_t begin, int64_t end, int64_t h, const RuleDims& d,
                        T scale) {
  const int64_t hk = h / d.group, state = d.dk * d.dv, len = end - begin;
  const int64_t chunks = (len + kGatedDeltaCheckpoint - 1) / kGatedDeltaCheckpoint;
  auto at = [](std::vector<T>& buf, int64_t i) { return buf.data() + i; };
  std::vector<T> checkpoints(static_cast<size_t>(chunks * state)), S(static_cast<size_t>(state), T(0));
  std::vector<T> u(static_cast<size_t>(d.dv));
  for (int64_t c = 0; c < chunks; ++c) {
    std::copy(S.begin(), S.end(), at(checkpoints, c * state));
    const int64_t stop = std::min(end, begin + (c + 1) * kGatedDeltaCheckpoint);
    for (int64_t t = begin + c * kGatedDeltaCheckpoint; t < stop; ++t) {
      rule_step(S.data(), u.data(), k + (t * d.hk + hk) * d.dk, v + (t * d.hv + h) * d.dv, g[t * d.hv + h],
                beta[t * d.hv + h], d.dk, d.dv);
    }
  }
  std::vector<T> decayed(static_cast<size_t>(kGatedDeltaCheckpoint * state));
  std::vector<T> us(static_cast<size_t>(kGatedDeltaCheckpoint * d.dv));
  std::vector<T> dS(static_cast<size_t>(state), T(0)), du(static_cast<size_t>(d.dv)), dvt(static_cast<size_t>(d.dv));
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t first = begin + c * kGatedDeltaCheckpoint, stop = std::min(end, first + kGatedDeltaCheckpoint);
    std::copy(at(checkpoints, c * state), at(checkpoints, (c + 1) * state), S.begin());
    for (int64_t t = first; t < stop; ++t) {
      const T decay = std::exp(g[t * d.hv + h]);
      T* St = at(decayed, (t - first) * state);
      for (int64_t e = 0; e < state; ++e) St[e] = S[static_cast<size_t>(e)] * decay;
      rule_step(S.data(), at(us, (t - first) * d.dv), k + (t * d.hk + hk) * d.dk, v + (t * d.hv + h) * d.dv,
                g[t * d.hv + h], beta[t * d.hv + h], d.dk, d.dv);
    }
    for (int64_t t = stop - 1; t >= first; --t) {
      const T* St = at(decayed, (t - first) * state);
      const T* ut = at(us, (t - first) * d.dv);
      const T* qt = q + (t * d.hk + hk) * d.dk;
      const T* kt = k + (t * d.hk + hk) * d.dk;
      const T* vt = v + (t * d.hv + h) * d.dv;
      const T* dot = dout + (t * d.hv + h) * d.dv;
      const T bt = beta[t * d.hv + h];
      T* dqt = dq_heads + (t * d.hv + h) * d.dk;
      T* dkt = dk_heads + (t * d.hv + h) * d.dk;
      for (int64_t i = 0; i < d.dk; ++i) {
        T sum = 0;
        for (int64_t j = 0; j < d.dv; ++j) sum += (St[i * d.dv + j] + kt[i] * ut[j]) * dot[j];
        dqt[i] = scale * sum;
        const T qs = qt[i] * scale;
        for (int64_t j = 0; j < d.dv; ++j) dS[static_cast<size_t>(i * d.dv + j)] += qs * dot[j];
      }
      T db = 0;
      for (int64_t j = 0; j < d.dv; ++j) {
        T sum = 0, kv = 0;
        for (int64_t i = 0; i < d.dk; ++i) {
          sum += dS[static_cast<size_t>(i * d.dv + j)] * kt[i];
          kv += St[i * d.dv + j] * kt[i];
        }
        du[static_cast<size_t>(j)] = sum;
        dvt[static_cast<size_t>(j)] = bt * sum;
        db += sum * (vt[j] - kv);
      }
      for (int64_t i = 0; i < d.dk; ++i) {
        T sum = 0;
        for (int64_t j = 0; j < d.dv; ++j) {
          sum += dS[static_cast<size_t>(i * d.dv + j)] * ut[j] - St[i * d.dv + j] * dvt[static_cast<size_t>(j)];
        }
        dkt[i] = sum;
      }
      T dgt = 0;
      for (int64_t i = 0; i < d.dk; ++i) {
        for (int64_t j = 0; j < d.dv; ++j) {
          T& e = dS[static_cast<size_t>(i * d.dv + j)];
          e -= kt[i] * dvt[static_cast<size_t>(j)];
          dgt += St[i * d.dv + j] * e;
        }
      }
      const T decay = std::exp(g[t * d.hv + h]);
      for (T& e : dS) e *= decay;
      for (int64_t j = 0; j < d.dv; ++j) dv[(t * d.hv + h) * d.dv + j] = dvt[static_cast<size_t>(j)];
      dg[t * d.hv + h] = dgt;
      dbeta[t * d.hv + h] = db;
    }
  }
}

}  // namespace

void causal_conv1d_silu_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens) {
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = w.size(1);
  const DocSpans spans = doc_spans(cu_seqlens, tokens);
  dispatch_float(x.dtype(), "causal_conv1d_silu_forward", [&]<typename T>() {
    T* yp = y.data<T>();
    const T* xp = x.data<T>();
    const T* wp = w.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        const T pre = conv_pre(xp, wp, t, c, channels, kernel, spans.start[static_cast<size_t>(t)]);
        yp[t * channels + c] = pre * sigmoid(pre);
      }
    }
  });
}

void causal_conv1d_silu_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                                 const Tensor& cu_seqlens) {
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = w.size(1);
  const DocSpans spans = doc_spans(cu_seqlens, tokens);
  dispatch_float(x.dtype(), "causal_conv1d_silu_backward", [&]<typename T>() {
    const T* xp = x.data<T>();
    const T* wp = w.data<T>();
    const T* dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    T* dwp = dw.data<T>();
    // dpre = dy * silu'(pre), then dx[t] = sum_j w[j] * dpre[t + K-1 - j] over the taps inside t's document.
    std::vector<T> dpre(static_cast<size_t>(tokens * channels));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        const T pre = conv_pre(xp, wp, t, c, channels, kernel, spans.start[static_cast<size_t>(t)]);
        dpre[static_cast<size_t>(t * channels + c)] = dyp[t * channels + c] * silu_grad(pre);
      }
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t end = spans.end[static_cast<size_t>(t)];
      for (int64_t c = 0; c < channels; ++c) {
        T sum = 0;
        for (int64_t j = kernel - 1; j >= 0; --j) {
          const int64_t dst = t + (kernel - 1) - j;
          if (dst < end) sum += wp[c * kernel + j] * dpre[static_cast<size_t>(dst * channels + c)];
        }
        dxp[t * channels + c] = sum;
      }
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < channels; ++c) {
      for (int64_t j = 0; j < kernel; ++j) {
        T sum = 0;
        for (int64_t t = 0; t < tokens; ++t) {
          const int64_t src = t - (kernel - 1) + j;
          if (src >= spans.start[static_cast<size_t>(t)])
            sum += dpre[static_cast<size_t>(t * channels + c)] * xp[src * channels + c];
        }
        dwp[c * kernel + j] += sum;
      }
    }
  });
}

void l2norm_forward(const Tensor& y, const Tensor& x, float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x.dtype(), "l2norm_forward", [&]<typename T>() {
    T* yp = y.data<T>();
    const T* xp = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      T sum = 0;
      for (int64_t d = 0; d < dim; ++d) sum += xp[n * dim + d] * xp[n * dim + d];
      const T r = T(1) / std::sqrt(sum + T(eps));
      for (int64_t d = 0; d < dim; ++d) yp[n * dim + d] = xp[n * dim + d] * r;
    }
  });
}

// dx = r * dy - x * r^3 * (dy . x), r = 1 / sqrt(sum(x^2) + eps).
void l2norm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x.dtype(), "l2norm_backward", [&]<typename T>() {
    T* dxp = dx.data<T>();
    const T* dyp = dy.data<T>();
    const T* xp = x.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      T sum = 0, dot = 0;
      for (int64_t d = 0; d < dim; ++d) {
        sum += xp[n * dim + d] * xp[n * dim + d];
        dot += dyp[n * dim + d] * xp[n * dim + d];
      }
      const T r = T(1) / std::sqrt(sum + T(eps));
      const T coef = r * r * r * dot;
      for (int64_t d = 0; d < dim; ++d) dxp[n * dim + d] = r * dyp[n * dim + d] - xp[n * dim + d] * coef;
    }
  });
}

void gated_delta_gates_forward(const Tensor& g, const Tensor& beta, const Tensor& a, const Tensor& b,
                               const Tensor& A_log, const Tensor& dt_bias) {
  const int64_t tokens = a.size(0), heads = a.size(1);
  dispatch_float(a.dtype(), "gated_delta_gates_forward", [&]<typename T>() {
    T* gp = g.data<T>();
    T* betap = beta.data<T>();
    const T* ap = a.data<T>();
    const T* bp = b.data<T>();
    const T* alog = A_log.data<T>();
    const T* bias = dt_bias.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        gp[t * heads + h] = -std::exp(alog[h]) * softplus(ap[t * heads + h] + bias[h]);
        betap[t * heads + h] = sigmoid(bp[t * heads + h]);
      }
    }
  });
}

// da = dg * -exp(A_log) * softplus'(a + dt_bias), ddt_bias += sum_t da, dA_log += sum_t dg * g, db = dbeta * s(1 - s).
void gated_delta_gates_backward(const Tensor& da, const Tensor& db, const Tensor& dA_log, const Tensor& ddt_bias,
                                const Tensor& dg, const Tensor& dbeta, const Tensor& a, const Tensor& b,
                                const Tensor& A_log, const Tensor& dt_bias) {
  const int64_t tokens = a.size(0), heads = a.size(1);
  dispatch_float(a.dtype(), "gated_delta_gates_backward", [&]<typename T>() {
    T* dap = da.data<T>();
    T* dbp = db.data<T>();
    const T* dgp = dg.data<T>();
    const T* dbetap = dbeta.data<T>();
    const T* ap = a.data<T>();
    const T* bp = b.data<T>();
    const T* alog = A_log.data<T>();
    const T* bias = dt_bias.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t e = t * heads + h;
        dap[e] = dgp[e] * -std::exp(alog[h]) * softplus_grad(ap[e] + bias[h]);
        const T s = sigmoid(bp[e]);
        dbp[e] = dbetap[e] * (s * (T(1) - s));
      }
    }
    T* dalog = dA_log.data<T>();
    T* dbias = ddt_bias.data<T>();
    for (int64_t h = 0; h < heads; ++h) {
      T sum_bias = 0, sum_alog = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t e = t * heads + h;
        sum_bias += dap[e];
        sum_alog += dgp[e] * (-std::exp(alog[h]) * softplus(ap[e] + bias[h]));
      }
      dbias[h] += sum_bias;
      dalog[h] += sum_alog;
    }
  });
}

void gated_delta_rule_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& cu_seqlens, float scale, const Tensor& final_state) {
  const RuleDims d = rule_dims(q, v);
  dispatch_float(q.dtype(), "gated_delta_rule_forward", [&]<typename T>() {
    rule_forward(out.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(), g.data<T>(), beta.data<T>(),
                 cu_seqlens.data<int32_t>(), cu_seqlens.numel() - 1, d, T(scale),
                 final_state.defined() ? final_state.data<T>() : nullptr);
  });
}

void gated_delta_rule_decode(const Tensor& out, const Tensor& state, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, float scale) {
  const RuleDims d = rule_dims(q, v);
  dispatch_float(q.dtype(), "gated_delta_rule_decode", [&]<typename T>() {
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < d.tokens * d.hv; ++item) {
      const int64_t b = item / d.hv, h = item % d.hv, hk = h / d.group;
      std::vector<T> u(static_cast<size_t>(d.dv)), qs(static_cast<size_t>(d.dk));
      rule_token(state.data<T>() + item * d.dk * d.dv, u.data(), qs.data(), q.data<T>() + (b * d.hk + hk) * d.dk,
                 k.data<T>() + (b * d.hk + hk) * d.dk, v.data<T>() + item * d.dv, g.data<T>()[item],
                 beta.data<T>()[item], out.data<T>() + item * d.dv, d, T(scale));
    }
  });
}

void causal_conv1d_silu_decode(const Tensor& y, const Tensor& history, const Tensor& w, const Tensor& lengths) {
  const int64_t rows = history.size(0), channels = history.size(2), kernel = w.size(1);
  dispatch_float(history.dtype(), "causal_conv1d_silu_decode", [&]<typename T>() {
    const int32_t* len = lengths.data<int32_t>();
    for (int64_t b = 0; b < rows; ++b) {
      const T* xb = history.data<T>() + b * history.size(1) * channels;
      for (int64_t c = 0; c < channels; ++c) {
        const T pre = conv_pre(xb, w.data<T>(), int64_t(len[b]) - 1, c, channels, kernel, 0);
        y.data<T>()[b * channels + c] = pre * sigmoid(pre);
      }
    }
  });
}

void gated_delta_rule_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg,
                               const Tensor& dbeta, const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                               float scale) {
  const RuleDims d = rule_dims(q, v);
  const int64_t docs = cu_seqlens.numel() - 1;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  dispatch_float(q.dtype(), "gated_delta_rule_backward", [&]<typename T>() {
    std::vector<T> dq_heads(static_cast<size_t>(d.tokens * d.hv * d.dk)), dk_heads(dq_heads.size());
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < docs * d.hv; ++item) {
      const int64_t doc = item / d.hv, h = item % d.hv;
      rule_backward_item(dq_heads.data(), dk_heads.data(), dv.data<T>(), dg.data<T>(), dbeta.data<T>(), dout.data<T>(),
                         q.data<T>(), k.data<T>(), v.data<T>(), g.data<T>(), beta.data<T>(), cu[doc], cu[doc + 1], h, d,
                         T(scale));
    }
    // The value heads of one key head, summed in ascending order.
    T* dqp = dq.data<T>();
    T* dkp = dk.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      for (int64_t hk = 0; hk < d.hk; ++hk) {
        for (int64_t i = 0; i < d.dk; ++i) {
          T sq = 0, sk = 0;
          for (int64_t m = 0; m < d.group; ++m) {
            const size_t e = static_cast<size_t>((t * d.hv + hk * d.group + m) * d.dk + i);
            sq += dq_heads[e];
            sk += dk_heads[e];
          }
          dqp[(t * d.hk + hk) * d.dk + i] = sq;
          dkp[(t * d.hk + hk) * d.dk + i] = sk;
        }
      }
    }
  });
}

void gated_rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& z, const Tensor& w,
                           float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x.dtype(), "gated_rmsnorm_forward", [&]<typename T>() {
    T* yp = y.data<T>();
    T* rp = rstd.data<T>();
    const T* xp = x.data<T>();
    const T* zp = z.data<T>();
    const T* wp = w.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      T sum = 0;
      for (int64_t d = 0; d < dim; ++d) sum += xp[n * dim + d] * xp[n * dim + d];
      const T r = T(1) / std::sqrt(sum / static_cast<T>(dim) + T(eps));
      rp[n] = r;
      for (int64_t d = 0; d < dim; ++d) {
        const T zv = zp[n * dim + d];
        yp[n * dim + d] = (wp[d] * (xp[n * dim + d] * r)) * (zv * sigmoid(zv));
      }
    }
  });
}

// With xhat = x * rstd and gx = dy * w * silu(z): dx = rstd * (gx - xhat * mean(gx * xhat)),
// dz = dy * w * xhat * silu'(z), dw += sum_n dy * xhat * silu(z).
void gated_rmsnorm_backward(const Tensor& dx, const Tensor& dz, const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const Tensor& z, const Tensor& w, const Tensor& rstd, float /*eps: rstd holds it*/) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x.dtype(), "gated_rmsnorm_backward", [&]<typename T>() {
    T* dxp = dx.data<T>();
    T* dzp = dz.data<T>();
    T* dwp = dw.data<T>();
    const T* dyp = dy.data<T>();
    const T* xp = x.data<T>();
    const T* zp = z.data<T>();
    const T* wp = w.data<T>();
    const T* rp = rstd.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      const T r = rp[n];
      T sum = 0;
      for (int64_t d = 0; d < dim; ++d) {
        const T zv = zp[n * dim + d];
        sum += (dyp[n * dim + d] * wp[d] * (zv * sigmoid(zv))) * (xp[n * dim + d] * r);
      }
      const T mean = sum / static_cast<T>(dim);
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t e = n * dim + d;
        const T zv = zp[e], xhat = xp[e] * r;
        const T gx = dyp[e] * wp[d] * (zv * sigmoid(zv));
        dxp[e] = r * (gx - xhat * mean);
        dzp[e] = dyp[e] * wp[d] * xhat * silu_grad(zv);
      }
    }
#pragma omp parallel for schedule(static)
    for (int64_t d = 0; d < dim; ++d) {
      T sum = 0;
      for (int64_t n = 0; n < rows; ++n) {
        const T zv = zp[n * dim + d];
        sum += dyp[n * dim + d] * (xp[n * dim + d] * rp[n]) * (zv * sigmoid(zv));
      }
      dwp[d] += sum;
    }
  });
}

}  // namespace moetrain::ops::cpu
