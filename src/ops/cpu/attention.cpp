// defines: the CPU attention reference. Every output element is computed by one thread with its reductions in
// ascending token order, and a query only ever reads its own document, so a document's rows do not depend on what
// else is packed into the micro-batch or on the thread count.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

struct Span {
  int64_t begin = 0;
  int64_t end = 0;
};

// The document [begin, end) of every token.
std::vector<Span> document_of_tokens(const Tensor& cu_seqlens) {
  const int32_t* cu = cu_seqlens.data<int32_t>();
  const int64_t num_docs = cu_seqlens.numel() - 1;
  std::vector<Span> spans(static_cast<size_t>(cu[num_docs]));
  for (int64_t d = 0; d < num_docs; ++d) {
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) spans[static_cast<size_t>(t)] = {cu[d], cu[d + 1]};
  }
  return spans;
}

// Keys visible to query i of document `doc`.
Span visible_keys(int64_t i, Span doc, const AttentionParams& params) {
  Span keys{doc.begin, params.causal ? i + 1 : doc.end};
  if (params.sliding_window > 0) {
    keys.begin = std::max(keys.begin, i - params.sliding_window + 1);
    if (!params.causal) keys.end = std::min(keys.end, i + params.sliding_window);
  }
  return keys;
}

// Queries that see key j of document `doc` (the transpose of visible_keys).
Span visible_queries(int64_t j, Span doc, const AttentionParams& params) {
  Span queries{params.causal ? j : doc.begin, doc.end};
  if (params.sliding_window > 0) {
    queries.end = std::min(queries.end, j + params.sliding_window);
    if (!params.causal) queries.begin = std::max(queries.begin, j - params.sliding_window + 1);
  }
  return queries;
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = T(0);
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[b] = dot(a, rows[b]) for kBlock rows at once: independent chains, each summed in ascending order, which
// keeps the adders busy. Callers fill a partial block by repeating its last valid row and ignore the extra
// results, so every dot product is computed by the same instructions wherever it falls in a block.
constexpr int64_t kBlock = 4;

template <typename T>
void dot_block(const T* a, const T* const (&rows)[kBlock], int64_t n, T (&out)[kBlock]) {
  T acc[kBlock] = {};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < kBlock; ++b) acc[b] += a[i] * rows[b][i];
  }
  for (int64_t b = 0; b < kBlock; ++b) out[b] = acc[b];
}

// y += a * x over n contiguous elements.
template <typename T>
void axpy(T* y, T a, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct Dims {
  int64_t tokens, nh, nkv, hd, hdv, group;
};

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t nh = q.size(1), nkv = k.size(1);
  return {q.size(0), nh, nkv, q.size(2), v.size(2), nh / nkv};
}

// One (query, head) of the forward: scores of the visible keys (rows keys.begin .. keys.end - 1 of k and v, kv head g,
// row stride nkv * hd / nkv * hdv), their softmax and the weighted sum of the values into oi [hdv]; returns the
// log-sum-exp. The training forward and the decoding forward (a cached prefix) both call it, so a query's bytes are
// the same whichever ran it, wherever its keys lie in memory.
template <typename T>
T attend_one(const T* qi, const T* kp, const T* vp, Span keys, int64_t g, const Dims& n, T scale, std::vector<T>& p,
             T* oi) {
  p.resize(static_cast<size_t>(keys.end - keys.begin));
  T max = -std::numeric_limits<T>::infinity();
  for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlock) {
    const T* rows[kBlock];
    for (int64_t b = 0; b < kBlock; ++b) rows[b] = kp + (std::min(j0 + b, keys.end - 1) * n.nkv + g) * n.hd;
    T dots[kBlock];
    dot_block(qi, rows, n.hd, dots);
    for (int64_t b = 0; b < std::min(kBlock, keys.end - j0); ++b) {
      const T s = dots[b] * scale;
      p[static_cast<size_t>(j0 + b - keys.begin)] = s;
      max = std::max(max, s);
    }
  }
  T sum = T(0);
  for (T& x : p) {
    x = std::exp(x - max);
    sum += x;
  }
  std::fill(oi, oi + n.hdv, T(0));
  for (int64_t j = keys.begin; j < keys.end; ++j) {
    axpy(oi, p[static_cast<size_t>(j - keys.begin)] / sum, vp + (j * n.nkv + g) * n.hdv, n.hdv);
  }
  return max + std::log(sum);
}

template <typename T>
void forward_impl(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& cu_seqlens, const AttentionParams& params) {
  const Dims n = dims_of(q, k, v);
  const std::vector<Span> docs = document_of_tokens(cu_seqlens);
  const T scale = static_cast<T>(params.softmax_scale);
  const T* qp = q.data<T>();
  const T* kp = k.data<T>();
  const T* vp = v.data<T>();
  T* op = out.data<T>();
  T* lp = lse.data<T>();
  const int64_t pairs = n.tokens * n.nh;
#pragma omp parallel
  {
    std::vector<T> p;  // scores, then probabilities, of the visible keys of one (query, head)
#pragma omp for schedule(dynamic, 4)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t i = pair / n.nh, h = pair % n.nh;
      const Span keys = visible_keys(i, docs[static_cast<size_t>(i)], params);
      lp[pair] = attend_one(qp + pair * n.hd, kp, vp, keys, h / n.group, n, scale, p, op + pair * n.hdv);
    }
  }
}

// The decoding forward: query b (its sequence's newest token, at position lengths[b] - 1) over rows 0 ..
// lengths[b] - 1 of its sequence's cache, the keys the training forward shows that token in its document.
template <typename T>
void decode_impl(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                 const Tensor& lengths, const AttentionParams& params) {
  const int64_t rows = q.size(0), capacity = k_cache.size(1);
  const Dims n{rows, q.size(1), k_cache.size(2), q.size(2), v_cache.size(3), q.size(1) / k_cache.size(2)};
  const T scale = static_cast<T>(params.softmax_scale);
  const int32_t* len = lengths.data<int32_t>();
  const int64_t pairs = rows * n.nh;
#pragma omp parallel
  {
    std::vector<T> p;
#pragma omp for schedule(dynamic, 4)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t b = pair / n.nh, h = pair % n.nh, last = len[b] - 1;
      const Span keys = visible_keys(last, Span{0, len[b]}, params);
      lse.data<T>()[pair] = attend_one(q.data<T>() + pair * n.hd, k_cache.data<T>() + b * capacity * n.nkv * n.hd,
                                       v_cache.data<T>() + b * capacity * n.nkv * n.hdv, keys, h / n.group, n, scale, p,
                                       out.data<T>() + pair * n.hdv);
    }
  }
}

template <typename T>
void backward_impl(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                   const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                   const AttentionParams& params) {
  const Dims n = dims_of(q, k, v);
  const std::vector<Span> docs = document_of_tokens(cu_seqlens);
  const T scale = static_cast<T>(params.softmax_scale);
  const T* qp = q.data<T>();
  const T* kp = k.data<T>();
  const T* vp = v.data<T>();
  const T* dop = dout.data<T>();
  const T* op = out.data<T>();
  const T* lp = lse.data<T>();
  T* dqp = dq.data<T>();
  T* dkp = dk.data<T>();
  T* dvp = dv.data<T>();

  // D[i, h] = dot(dout_i, out_i): the softmax backward's row term.
  const int64_t pairs = n.tokens * n.nh;
  std::vector<T> row_term(static_cast<size_t>(pairs));
#pragma omp parallel for
  for (int64_t pair = 0; pair < pairs; ++pair) {
    row_term[static_cast<size_t>(pair)] = dot(dop + pair * n.hdv, op + pair * n.hdv, n.hdv);
  }

  // dq_i = scale * sum_j dS_ij k_j, one (query, head) per iteration.
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t i = pair / n.nh, h = pair % n.nh, g = h / n.group;
    const Span keys = visible_keys(i, docs[static_cast<size_t>(i)], params);
    const T* qi = qp + pair * n.hd;
    const T* doi = dop + pair * n.hdv;
    T* dqi = dqp + pair * n.hd;
    std::fill(dqi, dqi + n.hd, T(0));
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlock) {
      const T* k_rows[kBlock];
      const T* v_rows[kBlock];
      for (int64_t b = 0; b < kBlock; ++b) {
        const int64_t j = std::min(j0 + b, keys.end - 1);
        k_rows[b] = kp + (j * n.nkv + g) * n.hd;
        v_rows[b] = vp + (j * n.nkv + g) * n.hdv;
      }
      T scores[kBlock], dprobs[kBlock];
      dot_block(qi, k_rows, n.hd, scores);
      dot_block(doi, v_rows, n.hdv, dprobs);
      for (int64_t b = 0; b < std::min(kBlock, keys.end - j0); ++b) {
        const T prob = std::exp(scores[b] * scale - lp[pair]);
        axpy(dqi, prob * (dprobs[b] - row_term[static_cast<size_t>(pair)]), k_rows[b], n.hd);
      }
    }
    for (int64_t d = 0; d < n.hd; ++d) dqi[d] *= scale;
  }

  // dk_j, dv_j: one (key token, kv head) per iteration, summing over the query heads of that kv head (ascending)
  // and, within a head, over the queries that see key j (ascending).
  const int64_t kv_pairs = n.tokens * n.nkv;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t kv_pair = 0; kv_pair < kv_pairs; ++kv_pair) {
    const int64_t j = kv_pair / n.nkv, g = kv_pair % n.nkv;
    const Span queries = visible_queries(j, docs[static_cast<size_t>(j)], params);
    const T* kj = kp + kv_pair * n.hd;
    const T* vj = vp + kv_pair * n.hdv;
    T* dkj = dkp + kv_pair * n.hd;
    T* dvj = dvp + kv_pair * n.hdv;
    std::fill(dkj, dkj + n.hd, T(0));
    std::fill(dvj, dvj + n.hdv, T(0));
    for (int64_t h = g * n.group; h < (g + 1) * n.group; ++h) {
      for (int64_t i0 = queries.begin; i0 < queries.end; i0 += kBlock) {
        const T* q_rows[kBlock];
        const T* do_rows[kBlock];
        for (int64_t b = 0; b < kBlock; ++b) {
          const int64_t pair = std::min(i0 + b, queries.end - 1) * n.nh + h;
          q_rows[b] = qp + pair * n.hd;
          do_rows[b] = dop + pair * n.hdv;
        }
        T scores[kBlock], dprobs[kBlock];
        dot_block(kj, q_rows, n.hd, scores);
        dot_block(vj, do_rows, n.hdv, dprobs);
        for (int64_t b = 0; b < std::min(kBlock, queries.end - i0); ++b) {
          const int64_t pair = (i0 + b) * n.nh + h;
          const T prob = std::exp(scores[b] * scale - lp[pair]);
          axpy(dvj, prob, do_rows[b], n.hdv);
          axpy(dkj, prob * (dprobs[b] - row_term[static_cast<size_t>(pair)]), q_rows[b], n.hd);
        }
      }
    }
    for (int64_t d = 0; d < n.hd; ++d) dkj[d] *= scale;
  }
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, const AttentionParams& params) {
  dispatch_float(q.dtype(), "attention_forward",
                 [&]<typename T>() { forward_impl<T>(out, lse, q, k, v, cu_seqlens, params); });
}

void attention_decode_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params) {
  dispatch_float(q.dtype(), "attention_decode_forward",
                 [&]<typename T>() { decode_impl<T>(out, lse, q, k_cache, v_cache, lengths, params); });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params) {
  dispatch_float(q.dtype(), "attention_backward",
                 [&]<typename T>() { backward_impl<T>(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params); });
}

}  // namespace moetrain::ops::cpu
