// Tests for the attention sinks of ops/attention (GPT-OSS): attention_forward + attention_sinks_forward against a
// direct f64 softmax with a sink column (causal, sliding window, packed documents shorter and longer than the window,
// GQA, hd != hdv); the backward (attention_backward on the sinked out / lse, attention_sinks_backward) against f64
// finite differences; a sink of -inf (or a very negative one) leaves plain attention bitwise; argument checks.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/attention.h"
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
  Tensor q, k, v, sinks;
};

Inputs random_inputs(const Dims& d, DType dtype, uint64_t seed) {
  Rng rng(seed);
  Inputs in{random_tensor({d.tokens, d.nh, d.hd}, dtype, rng), random_tensor({d.tokens, d.nkv, d.hd}, dtype, rng),
            random_tensor({d.tokens, d.nkv, d.hdv}, dtype, rng), random_tensor({d.nh}, dtype, rng, 1.5)};
  return in;
}

Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector<int32_t>(cu, {static_cast<int64_t>(cu.size())});
}

double value(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

// GPT-OSS's eager attention written out in f64: per document, query and head, the scaled scores of the visible keys
// (j <= i and i - j < window when the window is set) with the sink logit appended as one more column, a
// max-subtracted softmax over all of them, and the weighted sum of the keys' values (the sink column has none).
// lse is the log of the whole denominator, the sink included.
struct Reference {
  Tensor out, lse;  // f64
};

Reference reference_with_sinks(const Inputs& in, const std::vector<int32_t>& cu, const ops::AttentionParams& params) {
  const int64_t nh = in.q.size(1), hd = in.q.size(2), nkv = in.k.size(1), hdv = in.v.size(2);
  const int64_t tokens = in.q.size(0);
  Reference ref{Tensor::zeros({tokens, nh, hdv}, DType::F64), Tensor::zeros({tokens, nh}, DType::F64)};
  for (size_t doc = 0; doc + 1 < cu.size(); ++doc) {
    for (int64_t i = cu[doc]; i < cu[doc + 1]; ++i) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t g = h / (nh / nkv);
        std::vector<int64_t> keys;
        std::vector<double> logits;
        for (int64_t j = cu[doc]; j <= i; ++j) {
          if (params.sliding_window > 0 && i - j >= params.sliding_window) continue;
          double s = 0.0;
          for (int64_t d = 0; d < hd; ++d)
            s += value(in.q, (i * nh + h) * hd + d) * value(in.k, (j * nkv + g) * hd + d);
          keys.push_back(j);
          logits.push_back(s * params.softmax_scale);
        }
        logits.push_back(value(in.sinks, h));  // the sink column
        double max = -std::numeric_limits<double>::infinity();
        for (const double x : logits) max = std::max(max, x);
        double sum = 0.0;
        for (const double x : logits) sum += std::exp(x - max);
        for (size_t n = 0; n < keys.size(); ++n) {
          const double p = std::exp(logits[n] - max) / sum;
          for (int64_t d = 0; d < hdv; ++d) {
            ref.out.data<double>()[(i * nh + h) * hdv + d] += p * value(in.v, (keys[n] * nkv + g) * hdv + d);
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

// attention_forward, then attention_sinks_forward in place.
Outputs run_forward(const Inputs& in, const std::vector<int32_t>& cu, const ops::AttentionParams& params,
                    bool with_sinks = true) {
  const DType dtype = in.q.dtype();
  Outputs o{Tensor::empty({in.q.size(0), in.q.size(1), in.v.size(2)}, dtype),
            Tensor::empty({in.q.size(0), in.q.size(1)}, dtype)};
  ops::attention_forward(Stream::cpu(), o.out, o.lse, in.q, in.k, in.v, cu_tensor(cu), params);
  if (with_sinks) ops::attention_sinks_forward(Stream::cpu(), o.out, o.lse, in.sinks);
  return o;
}

struct Grads {
  Tensor dq, dk, dv, dsinks;
};

// attention_backward with the sinked out / lse, and attention_sinks_backward into a zeroed dsinks.
Grads run_backward(const Inputs& in, const Outputs& o, const Tensor& dout, const std::vector<int32_t>& cu,
                   const ops::AttentionParams& params) {
  Grads g{Tensor::empty(in.q.shape(), in.q.dtype()), Tensor::empty(in.k.shape(), in.k.dtype()),
          Tensor::empty(in.v.shape(), in.v.dtype()), Tensor::zeros(in.sinks.shape(), in.sinks.dtype())};
  ops::attention_backward(Stream::cpu(), g.dq, g.dk, g.dv, dout, in.q, in.k, in.v, o.out, o.lse, cu_tensor(cu), params);
  ops::attention_sinks_backward(Stream::cpu(), g.dsinks, dout, o.out, o.lse, in.sinks);
  return g;
}

ops::AttentionParams causal(float scale, int window) {
  ops::AttentionParams p;
  p.softmax_scale = scale;
  p.sliding_window = window;
  return p;
}

// Documents of 3, 2, 12 and 14 tokens: with a window of 4, two are shorter than the window and two longer.
const std::vector<int32_t> kDocs = {0, 3, 5, 17, 31};

TEST(AttentionSinks, ForwardMatchesSoftmaxWithASinkColumn) {
  const Dims d{31, 6, 2, 8, 5};  // GQA (3 query heads per kv head), hd != hdv
  for (const int window : {0, 4, 1}) {
    const ops::AttentionParams params = causal(0.45f, window);
    for (const DType dtype : {DType::F64, DType::F32}) {
      const Inputs in = random_inputs(d, dtype, 17);
      const Outputs o = run_forward(in, kDocs, params);
      const Reference ref = reference_with_sinks(in, kDocs, params);
      // f64: the same math in another order, rounding ~1e-16 per operation; f32: ~1e-7 per operation over sums of at
      // most 14 keys of head dim 8.
      const double tolerance = dtype == DType::F64 ? 1e-13 : 1e-5;
      EXPECT_LT(relative_error(o.out, ref.out), tolerance) << "window " << window << " " << dtype_name(dtype);
      EXPECT_LT(relative_error(o.lse, ref.lse), tolerance) << "window " << window << " " << dtype_name(dtype);
    }
  }
}

TEST(AttentionSinks, ForwardWithALargeSinkShrinksTheOutputTowardZero) {
  // A sink far above every score takes almost all of the probability: out ~ exp(scores - sink) v, lse ~ sink.
  const Dims d{9, 2, 1, 4, 4};
  Inputs in = random_inputs(d, DType::F64, 3);
  in.sinks.data<double>()[0] = 40.0;
  in.sinks.data<double>()[1] = -3.0;
  const Outputs o = run_forward(in, {0, 9}, causal(0.5f, 0));
  const Reference ref = reference_with_sinks(in, {0, 9}, causal(0.5f, 0));
  EXPECT_LT(relative_error(o.out, ref.out), 1e-13);
  EXPECT_LT(relative_error(o.lse, ref.lse), 1e-13);
  for (int64_t t = 0; t < d.tokens; ++t) {
    EXPECT_NEAR(o.lse.data<double>()[t * 2], 40.0, 1e-9) << "token " << t;
    for (int64_t c = 0; c < d.hdv; ++c) EXPECT_LT(std::abs(o.out.data<double>()[t * 8 + c]), 1e-9);
  }
}

// loss = sum(out' * w) with out' the sinked attention output: dq, dk, dv from attention_backward(w, sinked out,
// sinked lse) and dsinks from attention_sinks_backward must match central differences of the loss.
void expect_backward_matches_finite_differences(const Dims& d, const std::vector<int32_t>& cu,
                                                const ops::AttentionParams& params, uint64_t seed) {
  Inputs in = random_inputs(d, DType::F64, seed);
  Rng rng(seed + 1);
  const Tensor w = random_tensor({d.tokens, d.nh, d.hdv}, DType::F64, rng);
  const Outputs o = run_forward(in, cu, params);
  const Grads g = run_backward(in, o, w, cu, params);
  const auto loss = [&] { return testing::dot(run_forward(in, cu, params).out, w); };
  testing::expect_gradients_match(
      loss, {{"q", in.q, g.dq}, {"k", in.k, g.dk}, {"v", in.v, g.dv}, {"sinks", in.sinks, g.dsinks}});
}

TEST(AttentionSinks, BackwardMatchesFiniteDifferencesWithGqaAndPackedDocuments) {
  expect_backward_matches_finite_differences({12, 4, 2, 3, 2}, {0, 4, 5, 12}, causal(0.6f, 0), 21);
}

TEST(AttentionSinks, BackwardMatchesFiniteDifferencesWithSlidingWindow) {
  // Window 3 over documents of 2, 1, 6 and 5 tokens: shorter and longer than the window.
  expect_backward_matches_finite_differences({14, 4, 2, 3, 2}, {0, 2, 3, 9, 14}, causal(0.6f, 3), 31);
  expect_backward_matches_finite_differences({14, 6, 3, 4, 3}, {0, 2, 3, 9, 14}, causal(0.5f, 1), 41);
}

TEST(AttentionSinks, SinkGradientAccumulates) {
  const Dims d{10, 4, 2, 4, 3};
  const Inputs in = random_inputs(d, DType::F64, 51);
  Rng rng(52);
  const Tensor w = random_tensor({d.tokens, d.nh, d.hdv}, DType::F64, rng);
  const Outputs o = run_forward(in, {0, 10}, causal(0.5f, 3));
  Tensor once = Tensor::zeros({d.nh}, DType::F64), start = random_tensor({d.nh}, DType::F64, rng);
  Tensor acc = start.clone();
  ops::attention_sinks_backward(Stream::cpu(), once, w, o.out, o.lse, in.sinks);
  ops::attention_sinks_backward(Stream::cpu(), acc, w, o.out, o.lse, in.sinks);
  for (int64_t h = 0; h < d.nh; ++h) {
    EXPECT_DOUBLE_EQ(acc.data<double>()[h], start.data<double>()[h] + once.data<double>()[h]) << "head " << h;
  }
}

// Bytes of two tensors are identical.
void expect_identical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0) << what << " differs bitwise";
}

TEST(AttentionSinks, VeryNegativeSinkIsPlainAttention) {
  // exp(sink - lse) underflows to exactly 0: the scale is exactly 1 and lse is unchanged, so out, lse, dq, dk, dv
  // equal those of plain attention bitwise and the sink gradient is exactly 0.
  const Dims d{17, 4, 2, 8, 6};
  const ops::AttentionParams params = causal(0.35f, 5);
  const std::vector<int32_t> cu = {0, 3, 17};
  for (const DType dtype : {DType::F32, DType::F64}) {
    for (const double sink : {-1e30, -std::numeric_limits<double>::infinity()}) {
      Inputs in = random_inputs(d, dtype, 61);
      for (int64_t h = 0; h < d.nh; ++h) {
        if (dtype == DType::F64) {
          in.sinks.data<double>()[h] = sink;
        } else {
          in.sinks.data<float>()[h] = static_cast<float>(sink);
        }
      }
      Rng rng(62);
      const Tensor dout = random_tensor({d.tokens, d.nh, d.hdv}, dtype, rng);
      const Outputs plain = run_forward(in, cu, params, false), sinked = run_forward(in, cu, params, true);
      const std::string what = fmt::format("{} sink {}", dtype_name(dtype), sink);
      expect_identical(sinked.out, plain.out, what + ": out");
      expect_identical(sinked.lse, plain.lse, what + ": lse");
      const Grads gp = run_backward(in, plain, dout, cu, params), gs = run_backward(in, sinked, dout, cu, params);
      expect_identical(gs.dq, gp.dq, what + ": dq");
      expect_identical(gs.dk, gp.dk, what + ": dk");
      expect_identical(gs.dv, gp.dv, what + ": dv");
      EXPECT_EQ(testing::max_abs_diff(gs.dsinks, Tensor::zeros({d.nh}, dtype)), 0.0) << what << ": dsinks";
    }
  }
}

TEST(AttentionSinks, RejectsMismatchedShapesAndDtypes) {
  Stream& s = Stream::cpu();
  Rng rng(71);
  const Tensor out = random_tensor({6, 4, 3}, DType::F32, rng), lse = random_tensor({6, 4}, DType::F32, rng);
  const Tensor sinks = random_tensor({4}, DType::F32, rng), dout = random_tensor({6, 4, 3}, DType::F32, rng);
  Tensor dsinks = Tensor::zeros({4}, DType::F32);
  const Tensor out_before = out.clone(), lse_before = lse.clone();
  const auto fwd = [&](const Tensor& o, const Tensor& l, const Tensor& k) { ops::attention_sinks_forward(s, o, l, k); };
  const auto bwd = [&](const Tensor& ds, const Tensor& dy, const Tensor& o, const Tensor& l, const Tensor& k) {
    ops::attention_sinks_backward(s, ds, dy, o, l, k);
  };
  // out picks the shape and dtypes.
  expect_error([&] { fwd(Tensor(), lse, sinks); },
               "attention_sinks_forward: out: expected a tensor but found an undefined one");
  expect_error(
      [&] {
        fwd(out.view({24, 3}), lse, sinks);
      },
      "attention_sinks_forward: expected out [T, nh, hdv] but found");
  expect_error([&] { fwd(out.to(DType::BF16), lse, sinks); },
               "attention_sinks_forward: expected out in f32 or f64 but found");
  expect_error([&] { fwd(Tensor::zeros({6, 4, 3}, DType::I32), lse, sinks); }, "expected out in f32 or f64");
  // lse [T, nh] in out's dtype.
  expect_error([&] { fwd(out, Tensor(), sinks); },
               "attention_sinks_forward: lse: expected a tensor but found an undefined one");
  expect_error([&] { fwd(out, lse.slice(0, 5), sinks); },
               "attention_sinks_forward: lse: expected shape [6, 4] but found [5, 4]");
  expect_error(
      [&] {
        fwd(out, lse.view({6, 4, 1}), sinks);
      },
      "attention_sinks_forward: lse: expected shape [6, 4] but found [6, 4, 1]");
  expect_error([&] { fwd(out, lse.to(DType::F64), sinks); },
               "attention_sinks_forward: lse: expected dtype f32 but found f64");
  // sinks [nh] in out's dtype.
  expect_error([&] { fwd(out, lse, Tensor()); },
               "attention_sinks_forward: sinks: expected a tensor but found an undefined one");
  expect_error([&] { fwd(out, lse, random_tensor({3}, DType::F32, rng)); },
               "attention_sinks_forward: sinks: expected shape [4] but found [3]");
  expect_error(
      [&] {
        fwd(out, lse, sinks.view({1, 4}));
      },
      "attention_sinks_forward: sinks: expected shape [4] but found [1, 4]");
  expect_error([&] { fwd(out, lse, sinks.to(DType::F64)); },
               "attention_sinks_forward: sinks: expected dtype f32 but found f64");
  expect_error([&] { fwd(out.to(DType::F64), lse.to(DType::F64), sinks); },
               "attention_sinks_forward: sinks: expected dtype f64 but found f32");
  // The backward checks the same, plus dout (out's shape and dtype) and dsinks (sinks' shape and dtype).
  expect_error([&] { bwd(dsinks, dout, out, lse.slice(0, 5), sinks); },
               "attention_sinks_backward: lse: expected shape [6, 4] but found [5, 4]");
  expect_error([&] { bwd(dsinks, dout, out, lse, sinks.to(DType::F64)); },
               "attention_sinks_backward: sinks: expected dtype f32 but found f64");
  expect_error([&] { bwd(dsinks, Tensor(), out, lse, sinks); },
               "attention_sinks_backward: dout: expected a tensor but found an undefined one");
  expect_error([&] { bwd(dsinks, dout.slice(0, 5), out, lse, sinks); },
               "attention_sinks_backward: dout: expected shape [6, 4, 3] but found [5, 4, 3]");
  expect_error([&] { bwd(dsinks, dout.to(DType::F64), out, lse, sinks); },
               "attention_sinks_backward: dout: expected dtype f32 but found f64");
  expect_error([&] { bwd(Tensor(), dout, out, lse, sinks); },
               "attention_sinks_backward: dsinks: expected a tensor but found an undefined one");
  expect_error([&] { bwd(Tensor::zeros({6}, DType::F32), dout, out, lse, sinks); },
               "attention_sinks_backward: dsinks: expected shape [4] but found [6]");
  expect_error([&] { bwd(Tensor::zeros({4}, DType::F64), dout, out, lse, sinks); },
               "attention_sinks_backward: dsinks: expected dtype f32 but found f64");
  // The rejected calls wrote nothing; an accepted one runs.
  EXPECT_EQ(std::memcmp(out.raw_data(), out_before.raw_data(), out.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse.raw_data(), lse_before.raw_data(), lse.nbytes()), 0);
  EXPECT_EQ(testing::max_abs_diff(dsinks, Tensor::zeros({4}, DType::F32)), 0.0);
  EXPECT_NO_THROW(fwd(out, lse, sinks));
  EXPECT_NO_THROW(bwd(dsinks, dout, out, lse, sinks));
}

TEST(AttentionSinks, EmptyBatchIsANoOp) {
  Stream& s = Stream::cpu();
  Tensor out = Tensor::empty({0, 4, 3}, DType::F32), lse = Tensor::empty({0, 4}, DType::F32);
  const Tensor sinks = Tensor::zeros({4}, DType::F32);
  Tensor dsinks = Tensor::from_vector<float>({1.0f, 2.0f, 3.0f, 4.0f}, {4});
  ops::attention_sinks_forward(s, out, lse, sinks);
  ops::attention_sinks_backward(s, dsinks, out, out, lse, sinks);
  EXPECT_EQ(dsinks.data<float>()[3], 4.0f);
}

}  // namespace
}  // namespace moetrain
