// Tests for ops/attention: forward against an explicit masked softmax per document (GQA, single-token documents,
// sliding window, non-causal), packing invariance, backward against finite differences, and argument checks.
#include "ops/attention.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "core/error.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;
using testing::relative_error;

struct Dims {
  int64_t tokens, nh, nkv, hd, hdv;
};

struct Inputs {
  Tensor q, k, v;
};

Inputs random_inputs(const Dims& d, DType dtype, uint64_t seed) {
  Rng rng(seed);
  return {random_tensor({d.tokens, d.nh, d.hd}, dtype, rng), random_tensor({d.tokens, d.nkv, d.hd}, dtype, rng),
          random_tensor({d.tokens, d.nkv, d.hdv}, dtype, rng)};
}

Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector<int32_t>(cu, {static_cast<int64_t>(cu.size())});
}

double value(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

// The attention of record written out directly in f64: for every document, query and head, a score row over the
// whole document with masked entries at -inf, a max-subtracted softmax over it, and the weighted sum of values.
struct Reference {
  Tensor out, lse;  // f64
};

Reference reference_attention(const Inputs& in, const std::vector<int32_t>& cu, const ops::AttentionParams& params) {
  const int64_t tokens = in.q.size(0), nh = in.q.size(1), hd = in.q.size(2), nkv = in.k.size(1), hdv = in.v.size(2);
  Reference ref{Tensor::zeros({tokens, nh, hdv}, DType::F64), Tensor::zeros({tokens, nh}, DType::F64)};
  const double inf = std::numeric_limits<double>::infinity();
  for (size_t doc = 0; doc + 1 < cu.size(); ++doc) {
    const int64_t begin = cu[doc], end = cu[doc + 1];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t g = h / (nh / nkv);
        std::vector<double> scores(static_cast<size_t>(end - begin));
        double max = -inf;
        for (int64_t j = begin; j < end; ++j) {
          bool visible = !params.causal || j <= i;
          if (params.sliding_window > 0) visible = visible && std::abs(i - j) < params.sliding_window;
          double s = -inf;
          if (visible) {
            s = 0.0;
            for (int64_t d = 0; d < hd; ++d)
              s += value(in.q, (i * nh + h) * hd + d) * value(in.k, (j * nkv + g) * hd + d);
            s *= params.softmax_scale;
          }
          scores[static_cast<size_t>(j - begin)] = s;
          max = std::max(max, s);
        }
        double sum = 0.0;
        for (double& s : scores) {
          s = std::exp(s - max);
          sum += s;
        }
        for (int64_t j = begin; j < end; ++j) {
          const double p = scores[static_cast<size_t>(j - begin)] / sum;
          for (int64_t d = 0; d < hdv; ++d) {
            ref.out.data<double>()[(i * nh + h) * hdv + d] += p * value(in.v, (j * nkv + g) * hdv + d);
          }
        }
        ref.lse.data<double>()[i * nh + h] = max + std::log(sum);
      }
    }
  }
  return ref;
}

struct Outputs {
  Tensor out, lse;
};

Outputs run_forward(const Inputs& in, const std::vector<int32_t>& cu, const ops::AttentionParams& params) {
  const DType dtype = in.q.dtype();
  Outputs o{Tensor::empty({in.q.size(0), in.q.size(1), in.v.size(2)}, dtype),
            Tensor::empty({in.q.size(0), in.q.size(1)}, dtype)};
  ops::attention_forward(Stream::cpu(), o.out, o.lse, in.q, in.k, in.v, cu_tensor(cu), params);
  return o;
}

struct Grads {
  Tensor dq, dk, dv;
};

Grads run_backward(const Inputs& in, const Outputs& o, const Tensor& dout, const std::vector<int32_t>& cu,
                   const ops::AttentionParams& params) {
  Grads g{Tensor::empty(in.q.shape(), in.q.dtype()), Tensor::empty(in.k.shape(), in.k.dtype()),
          Tensor::empty(in.v.shape(), in.v.dtype())};
  ops::attention_backward(Stream::cpu(), g.dq, g.dk, g.dv, dout, in.q, in.k, in.v, o.out, o.lse, cu_tensor(cu), params);
  return g;
}

void expect_matches_reference(const Dims& d, const std::vector<int32_t>& cu, const ops::AttentionParams& params) {
  const Inputs in = random_inputs(d, DType::F32, 7);
  const Outputs o = run_forward(in, cu, params);
  const Reference ref = reference_attention(in, cu, params);
  EXPECT_LT(relative_error(o.out, ref.out), 1e-5);
  EXPECT_LT(relative_error(o.lse, ref.lse), 1e-5);
}

// Bytes [begin, end) of dim 0 of two tensors are identical.
void expect_rows_identical(const Tensor& a, int64_t a_begin, const Tensor& b, int64_t b_begin, int64_t rows,
                           const char* what) {
  const Tensor sa = a.slice(a_begin, a_begin + rows), sb = b.slice(b_begin, b_begin + rows);
  ASSERT_EQ(sa.nbytes(), sb.nbytes()) << what;
  EXPECT_EQ(std::memcmp(sa.raw_data(), sb.raw_data(), sa.nbytes()), 0) << what << " differs bitwise";
}

TEST(Attention, ForwardMatchesMaskedSoftmaxWithGqaAndSingleTokenDocuments) {
  const Dims d{20, 4, 2, 8, 6};
  ops::AttentionParams params;
  params.softmax_scale = 1.0f / std::sqrt(8.0f);
  expect_matches_reference(d, {0, 5, 6, 13, 14, 20}, params);
  expect_matches_reference(d, {0, 20}, params);
}

TEST(Attention, ForwardMatchesMaskedSoftmaxWithSlidingWindow) {
  const Dims d{17, 4, 2, 8, 8};
  ops::AttentionParams params;
  params.softmax_scale = 0.4f;
  params.sliding_window = 3;
  expect_matches_reference(d, {0, 9, 10, 17}, params);
  params.sliding_window = 1;  // each query sees only itself
  expect_matches_reference(d, {0, 9, 10, 17}, params);
}

TEST(Attention, ForwardWithoutCausalMaskSeesWholeDocumentOrSymmetricWindow) {
  const Dims d{12, 2, 1, 4, 4};
  ops::AttentionParams params;
  params.softmax_scale = 0.5f;
  params.causal = false;
  expect_matches_reference(d, {0, 7, 12}, params);
  params.sliding_window = 2;
  expect_matches_reference(d, {0, 7, 12}, params);
}

TEST(Attention, SingleTokenDocumentOutputsItsValue) {
  const Dims d{3, 2, 1, 4, 3};
  const Inputs in = random_inputs(d, DType::F32, 3);
  const Outputs o = run_forward(in, {0, 1, 2, 3}, {});
  for (int64_t t = 0; t < d.tokens; ++t) {
    for (int64_t h = 0; h < d.nh; ++h) {
      for (int64_t c = 0; c < d.hdv; ++c) {
        EXPECT_EQ(o.out.data<float>()[(t * d.nh + h) * d.hdv + c], in.v.data<float>()[t * d.hdv + c]);
      }
    }
  }
}

TEST(Attention, PackedDocumentRowsAreBitwiseIdenticalToTheDocumentAlone) {
  // Document A (7 tokens) alone, and packed after documents of 5 and 3 tokens and before one of 4.
  const Dims alone{7, 4, 2, 8, 8}, packed{19, 4, 2, 8, 8};
  const Inputs a = random_inputs(alone, DType::F32, 11);
  Inputs p = random_inputs(packed, DType::F32, 12);
  p.q.slice(8, 15).copy_from(a.q);
  p.k.slice(8, 15).copy_from(a.k);
  p.v.slice(8, 15).copy_from(a.v);
  Rng rng(13);
  const Tensor dout_a = random_tensor({7, 4, 8}, DType::F32, rng);
  Tensor dout_p = random_tensor({19, 4, 8}, DType::F32, rng);
  dout_p.slice(8, 15).copy_from(dout_a);

  for (int window : {0, 3}) {
    ops::AttentionParams params;
    params.softmax_scale = 0.35f;
    params.sliding_window = window;
    const std::vector<int32_t> cu_a{0, 7}, cu_p{0, 5, 8, 15, 19};
    const Outputs oa = run_forward(a, cu_a, params), op = run_forward(p, cu_p, params);
    expect_rows_identical(op.out, 8, oa.out, 0, 7, "out");
    expect_rows_identical(op.lse, 8, oa.lse, 0, 7, "lse");
    const Grads ga = run_backward(a, oa, dout_a, cu_a, params), gp = run_backward(p, op, dout_p, cu_p, params);
    expect_rows_identical(gp.dq, 8, ga.dq, 0, 7, "dq");
    expect_rows_identical(gp.dk, 8, ga.dk, 0, 7, "dk");
    expect_rows_identical(gp.dv, 8, ga.dv, 0, 7, "dv");
  }
}

TEST(Attention, DecodingOverACacheGivesTheTrainingForwardsBytes) {
  // Three sequences of 9, 1 and 14 tokens packed as documents; a cache of capacity 16 holds each sequence's keys and
  // values (the rows past its length are garbage, never read). Decoding each sequence's newest token over its cache
  // gives the bytes of that token's row in the packed forward: causal, and with windows shorter than a sequence.
  for (DType dtype : {DType::F32, DType::F64}) {
    const std::vector<int32_t> cu{0, 9, 10, 24}, lengths{9, 1, 14};
    const int64_t capacity = 16;
    const Dims d{24, 6, 2, 8, 5};
    const Inputs in = random_inputs(d, dtype, 41);
    Rng rng(42);
    Tensor k_cache = random_tensor({3, capacity, d.nkv, d.hd}, dtype, rng);
    Tensor v_cache = random_tensor({3, capacity, d.nkv, d.hdv}, dtype, rng);
    Tensor q_newest = Tensor::empty({3, d.nh, d.hd}, dtype);
    for (int64_t b = 0; b < 3; ++b) {
      k_cache.select(b).slice(0, lengths[b]).copy_from(in.k.slice(cu[b], cu[b + 1]));
      v_cache.select(b).slice(0, lengths[b]).copy_from(in.v.slice(cu[b], cu[b + 1]));
      q_newest.select(b).copy_from(in.q.select(cu[b + 1] - 1));
    }
    for (int window : {0, 3, 9}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " window " + std::to_string(window));
      ops::AttentionParams params;
      params.softmax_scale = 0.4f;
      params.sliding_window = window;
      const Outputs full = run_forward(in, cu, params);
      Tensor out = Tensor::empty({3, d.nh, d.hdv}, dtype), lse = Tensor::empty({3, d.nh}, dtype);
      ops::attention_decode_forward(Stream::cpu(), out, lse, q_newest, k_cache, v_cache,
                                    Tensor::from_vector(lengths, {3}), params);
      for (int64_t b = 0; b < 3; ++b) {
        expect_rows_identical(out, b, full.out, cu[b + 1] - 1, 1, "out");
        expect_rows_identical(lse, b, full.lse, cu[b + 1] - 1, 1, "lse");
      }
    }
  }
}

TEST(Attention, DecodingRefusesBadCachesAndLengths) {
  Rng rng(43);
  const Tensor q = random_tensor({2, 4, 8}, DType::F32, rng);
  const Tensor k = random_tensor({2, 5, 2, 8}, DType::F32, rng), v = random_tensor({2, 5, 2, 8}, DType::F32, rng);
  Tensor out = Tensor::empty({2, 4, 8}, DType::F32), lse = Tensor::empty({2, 4}, DType::F32);
  const ops::AttentionParams params{0.3f, true, 0};
  const auto refused = [&](const Tensor& kc, const Tensor& lengths, const ops::AttentionParams& p,
                           const std::string& needle) {
    try {
      ops::attention_decode_forward(Stream::cpu(), out, lse, q, kc, v, lengths, p);
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused(k, Tensor::from_vector<int32_t>({3, 0}, {2}), params, "lengths[1] = 0 must be in [1, C = 5]");
  refused(k, Tensor::from_vector<int32_t>({6, 1}, {2}), params, "lengths[0] = 6 must be in [1, C = 5]");
  refused(k, Tensor::from_vector<int32_t>({1}, {1}), params, "attention_decode_forward: lengths");
  refused(random_tensor({2, 5, 3, 8}, DType::F32, rng), Tensor::from_vector<int32_t>({1, 1}, {2}), params,
          "must be a multiple of the kv heads");
  ops::AttentionParams bidirectional = params;
  bidirectional.causal = false;
  refused(k, Tensor::from_vector<int32_t>({1, 1}, {2}), bidirectional, "decoding is causal");
}

TEST(Attention, ResultsAreIdenticalForAnyThreadCount) {
  const Dims d{23, 4, 2, 8, 8};
  const std::vector<int32_t> cu{0, 10, 11, 23};
  const Inputs in = random_inputs(d, DType::F32, 5);
  Rng rng(6);
  const Tensor dout = random_tensor({d.tokens, d.nh, d.hdv}, DType::F32, rng);
  const ops::AttentionParams params{0.3f, true, 0};
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs o1 = run_forward(in, cu, params);
  const Grads g1 = run_backward(in, o1, dout, cu, params);
  omp_set_num_threads(3);
  const Outputs o3 = run_forward(in, cu, params);
  const Grads g3 = run_backward(in, o3, dout, cu, params);
  omp_set_num_threads(threads);
  expect_rows_identical(o1.out, 0, o3.out, 0, d.tokens, "out");
  expect_rows_identical(o1.lse, 0, o3.lse, 0, d.tokens, "lse");
  expect_rows_identical(g1.dq, 0, g3.dq, 0, d.tokens, "dq");
  expect_rows_identical(g1.dk, 0, g3.dk, 0, d.tokens, "dk");
  expect_rows_identical(g1.dv, 0, g3.dv, 0, d.tokens, "dv");
}

// loss = dot(out, R): the backward with dout = R must match central differences for q, k and v.
void expect_backward_matches_finite_differences(const Dims& d, const std::vector<int32_t>& cu,
                                                const ops::AttentionParams& params) {
  Inputs in = random_inputs(d, DType::F64, 21);
  Rng rng(22);
  const Tensor r = random_tensor({d.tokens, d.nh, d.hdv}, DType::F64, rng);
  const Outputs o = run_forward(in, cu, params);
  const Grads g = run_backward(in, o, r, cu, params);
  const auto loss = [&] { return testing::dot(run_forward(in, cu, params).out, r); };
  testing::expect_gradients_match(loss, {{"q", in.q, g.dq}, {"k", in.k, g.dk}, {"v", in.v, g.dv}});
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithGqaAndSeveralDocuments) {
  ops::AttentionParams params;
  params.softmax_scale = 0.6f;
  expect_backward_matches_finite_differences({10, 4, 2, 3, 2}, {0, 4, 5, 10}, params);
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithSlidingWindow) {
  ops::AttentionParams params;
  params.softmax_scale = 0.6f;
  params.sliding_window = 2;
  expect_backward_matches_finite_differences({10, 4, 2, 3, 2}, {0, 7, 10}, params);
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithoutCausalMask) {
  ops::AttentionParams params;
  params.softmax_scale = 0.6f;
  params.causal = false;
  expect_backward_matches_finite_differences({8, 2, 1, 3, 2}, {0, 5, 8}, params);
  params.sliding_window = 2;
  expect_backward_matches_finite_differences({8, 2, 1, 3, 2}, {0, 5, 8}, params);
}

TEST(Attention, ValidateCuSeqlensNamesTheBrokenRule) {
  const char* what = "test: cu_seqlens";
  expect_error([&] { ops::validate_cu_seqlens(Tensor::zeros({3}, DType::I64), 4, what); },
               "test: cu_seqlens: expected dtype i32 but found i64");
  expect_error(
      [&] {
        ops::validate_cu_seqlens(Tensor::zeros({2, 2}, DType::I32), 4, what);
      },
      "test: cu_seqlens: expected a 1-D tensor");
  expect_error([&] { ops::validate_cu_seqlens(cu_tensor({0}), 0, what); },
               "test: cu_seqlens: expected at least 2 entries (one document) but found 1");
  expect_error(
      [&] {
        ops::validate_cu_seqlens(cu_tensor({1, 2, 4}), 4, what);
      },
      "test: cu_seqlens: entry [0] must be 0 but found 1");
  expect_error(
      [&] {
        ops::validate_cu_seqlens(cu_tensor({0, 2, 2, 4}), 4, what);
      },
      "test: cu_seqlens: entries must strictly increase but entry [2] = 2 follows entry [1] = 2");
  expect_error(
      [&] {
        ops::validate_cu_seqlens(cu_tensor({0, 3, 1, 4}), 4, what);
      },
      "entry [2] = 1 follows entry [1] = 3");
  expect_error(
      [&] {
        ops::validate_cu_seqlens(cu_tensor({0, 2, 3}), 4, what);
      },
      "test: cu_seqlens: the last entry [2] must equal the token count 4 but found 3");
  EXPECT_NO_THROW(ops::validate_cu_seqlens(cu_tensor({0, 1, 4}), 4, what));
}

TEST(Attention, ForwardAndBackwardRejectBadCuSeqlens) {
  const Dims d{6, 2, 1, 4, 4};
  const Inputs in = random_inputs(d, DType::F32, 1);
  expect_error([&] { run_forward(in, {0, 3, 5}, {}); }, "attention_forward: cu_seqlens: the last entry [2]");
  const Outputs o = run_forward(in, {0, 6}, {});
  expect_error(
      [&] {
        run_backward(in, o, o.out, {0, 4, 4, 6}, {});
      },
      "attention_backward: cu_seqlens: entries must strictly increase but entry [2] = 4");
}

TEST(Attention, RejectsMismatchedShapesAndDtypes) {
  const Dims d{6, 4, 2, 4, 3};
  const Inputs in = random_inputs(d, DType::F32, 1);
  const Tensor cu = cu_tensor({0, 6});
  Stream& s = Stream::cpu();
  Tensor out = Tensor::empty({6, 4, 3}, DType::F32), lse = Tensor::empty({6, 4}, DType::F32);
  Rng rng(2);
  expect_error([&] { ops::attention_forward(s, out, lse, in.q, in.k.slice(0, 5), in.v, cu, {}); },
               "attention_forward: k: expected shape [6, 2, 4] but found [5, 2, 4]");
  expect_error(
      [&] {
        ops::attention_forward(s, out, lse, in.q, random_tensor({6, 3, 4}, DType::F32, rng),
                               random_tensor({6, 3, 3}, DType::F32, rng), cu, {});
      },
      "the query heads (nh = 4) must be a multiple of the kv heads (nkv = 3)");
  expect_error(
      [&] {
        ops::attention_forward(s, Tensor::empty({6, 4, 4}, DType::F32), lse, in.q, in.k, in.v, cu, {});
      },
      "attention_forward: out: expected shape [6, 4, 3] but found [6, 4, 4]");
  expect_error(
      [&] {
        ops::attention_forward(s, out, Tensor::empty({6, 2}, DType::F32), in.q, in.k, in.v, cu, {});
      },
      "attention_forward: lse: expected shape [6, 4] but found [6, 2]");
  expect_error([&] { ops::attention_forward(s, out, lse, in.q, in.k, in.v.to(DType::F64), cu, {}); },
               "attention_forward: v: expected dtype f32 but found f64");
  expect_error(
      [&] {
        ops::attention_forward(s, out, lse, in.q, in.k, in.v, cu, {1.0f, true, -1});
      },
      "sliding_window must be >= 0");
  ops::attention_forward(s, out, lse, in.q, in.k, in.v, cu, {});
  Tensor dq = Tensor::empty(in.q.shape(), DType::F32), dk = Tensor::empty(in.k.shape(), DType::F32),
         dv = Tensor::empty(in.v.shape(), DType::F32);
  expect_error([&] { ops::attention_backward(s, dq, dk, dv, out.slice(0, 5), in.q, in.k, in.v, out, lse, cu, {}); },
               "attention_backward: dout: expected shape [6, 4, 3] but found [5, 4, 3]");
  expect_error([&] { ops::attention_backward(s, dq, dv, dv, out, in.q, in.k, in.v, out, lse, cu, {}); },
               "attention_backward: dk: expected shape [6, 2, 4] but found [6, 2, 3]");
}

}  // namespace
}  // namespace moetrain
