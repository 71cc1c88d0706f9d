// Tests for ops/gated_delta: each Gated DeltaNet op's forward against a direct f64 formula written here (the rule as
// its recurrence, per document), every backward against f64 finite differences, packed documents (single-token ones,
// ones shorter than the conv kernel, one crossing the backward's 64-token checkpoints), Hv = 2 Hk, f32 against f64,
// transformers 5.17's own functions (tests/data/gated_delta/fixture.safetensors), and the refusals.
#include "ops/gated_delta.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "io/safetensors.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::expect_error;
using testing::random_tensor;

Tensor cu_of(const std::vector<int32_t>& cu) { return Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}); }

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// A tensor of `shape` in f64 with values from `f(index)`.
template <typename F>
Tensor make(const Shape& shape, F f) {
  Tensor t = Tensor::empty(shape, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = f(i);
  return t;
}

// Documents of 1, 2 (shorter than the kernel), 7, 1 and 5 tokens.
const std::vector<int32_t> kConvDocs = {0, 1, 3, 10, 11, 16};

TEST(GatedDelta, ConvForwardMatchesDirectFormulaPerDocument) {
  Rng rng(1);
  const int64_t T = 16, C = 5, K = 4;
  const Tensor x = random_tensor({T, C}, DType::F64, rng), w = random_tensor({C, K}, DType::F64, rng, 0.5);
  Tensor y = Tensor::empty({T, C}, DType::F64);
  causal_conv1d_silu_forward(Stream::cpu(), y, x, w, cu_of(kConvDocs));
  const double *xp = x.data<double>(), *wp = w.data<double>();
  for (size_t d = 0; d + 1 < kConvDocs.size(); ++d) {
    for (int64_t t = kConvDocs[d]; t < kConvDocs[d + 1]; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        double pre = 0;  // zero rows before the document's first token
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - (K - 1) + j;
          if (src >= kConvDocs[d]) pre += wp[c * K + j] * xp[src * C + c];
        }
        EXPECT_NEAR(y.data<double>()[t * C + c], pre * sigmoid(pre), 1e-14) << "t " << t << " c " << c;
      }
    }
  }
}

TEST(GatedDelta, ConvBackwardMatchesFiniteDifferences) {
  Rng rng(2);
  const int64_t T = 16, C = 3, K = 4;
  Tensor x = random_tensor({T, C}, DType::F64, rng), w = random_tensor({C, K}, DType::F64, rng, 0.5);
  const Tensor up = random_tensor({T, C}, DType::F64, rng);
  const Tensor cu = cu_of(kConvDocs);
  Tensor y = Tensor::empty({T, C}, DType::F64);
  auto loss = [&] {
    causal_conv1d_silu_forward(Stream::cpu(), y, x, w, cu);
    return testing::dot(y, up);
  };
  Tensor dx = Tensor::empty({T, C}, DType::F64);
  const Tensor start = random_tensor({C, K}, DType::F64, rng);
  Tensor dw = start.clone();
  causal_conv1d_silu_backward(Stream::cpu(), dx, dw, up, x, w, cu);
  Tensor dw_only = Tensor::empty({C, K}, DType::F64);
  for (int64_t i = 0; i < dw.numel(); ++i) dw_only.data<double>()[i] = dw.data<double>()[i] - start.data<double>()[i];
  testing::expect_gradients_match(loss, {{"x", x, dx}, {"w", w, dw_only}});
}

TEST(GatedDelta, L2NormForwardAndBackward) {
  Rng rng(3);
  Tensor x = random_tensor({3, 2, 6}, DType::F64, rng);
  const Tensor up = random_tensor({3, 2, 6}, DType::F64, rng);
  const float eps = 1e-6f;
  Tensor y = Tensor::empty({3, 2, 6}, DType::F64);
  l2norm_forward(Stream::cpu(), y, x, eps);
  for (int64_t n = 0; n < 6; ++n) {
    double sum = 0;
    for (int64_t d = 0; d < 6; ++d) sum += x.data<double>()[n * 6 + d] * x.data<double>()[n * 6 + d];
    for (int64_t d = 0; d < 6; ++d) {
      EXPECT_NEAR(y.data<double>()[n * 6 + d], x.data<double>()[n * 6 + d] / std::sqrt(sum + double(eps)), 1e-15);
    }
  }
  auto loss = [&] {
    l2norm_forward(Stream::cpu(), y, x, eps);
    return testing::dot(y, up);
  };
  Tensor dx = Tensor::empty({3, 2, 6}, DType::F64);
  l2norm_backward(Stream::cpu(), dx, up, x, eps);
  testing::expect_gradients_match(loss, {{"x", x, dx}});
}

TEST(GatedDelta, GatesForwardAndBackward) {
  Rng rng(4);
  const int64_t T = 7, H = 3;
  Tensor a = random_tensor({T, H}, DType::F64, rng, 2.0), b = random_tensor({T, H}, DType::F64, rng, 2.0);
  Tensor A_log = random_tensor({H}, DType::F64, rng), dt_bias = random_tensor({H}, DType::F64, rng);
  a.data<double>()[4] = 25.0;  // above torch's softplus threshold (20): linear there
  Tensor g = Tensor::empty({T, H}, DType::F64), beta = Tensor::empty({T, H}, DType::F64);
  gated_delta_gates_forward(Stream::cpu(), g, beta, a, b, A_log, dt_bias);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const double x = a.data<double>()[t * H + h] + dt_bias.data<double>()[h];
      const double sp = x > 20 ? x : std::log(1.0 + std::exp(x));
      EXPECT_NEAR(g.data<double>()[t * H + h], -std::exp(A_log.data<double>()[h]) * sp, 1e-13);
      EXPECT_NEAR(beta.data<double>()[t * H + h], sigmoid(b.data<double>()[t * H + h]), 1e-15);
    }
  }
  const Tensor ug = random_tensor({T, H}, DType::F64, rng), ub = random_tensor({T, H}, DType::F64, rng);
  auto loss = [&] {
    gated_delta_gates_forward(Stream::cpu(), g, beta, a, b, A_log, dt_bias);
    return testing::dot(g, ug) + testing::dot(beta, ub);
  };
  Tensor da = Tensor::empty({T, H}, DType::F64), db = Tensor::empty({T, H}, DType::F64);
  Tensor dA_log = Tensor::zeros({H}, DType::F64), ddt_bias = Tensor::zeros({H}, DType::F64);
  gated_delta_gates_backward(Stream::cpu(), da, db, dA_log, ddt_bias, ug, ub, a, b, A_log, dt_bias);
  testing::expect_gradients_match(
      loss, {{"a", a, da}, {"b", b, db}, {"A_log", A_log, dA_log}, {"dt_bias", dt_bias, ddt_bias}});
  // += : a second call doubles them.
  const Tensor first = dA_log.clone();
  gated_delta_gates_backward(Stream::cpu(), da, db, dA_log, ddt_bias, ug, ub, a, b, A_log, dt_bias);
  for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(dA_log.data<double>()[h], 2 * first.data<double>()[h], 1e-12);
}

// The inputs of the rule: q and k L2-normalised rows, g <= 0 (log-decay), beta in (0, 1).
struct RuleInputs {
  Tensor q, k, v, g, beta;
};

RuleInputs rule_inputs(int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, Rng& rng) {
  RuleInputs in{random_tensor({T, hk, dk}, DType::F64, rng),
                random_tensor({T, hk, dk}, DType::F64, rng),
                random_tensor({T, hv, dv}, DType::F64, rng),
                {},
                {}};
  for (Tensor* t : {&in.q, &in.k}) {
    Tensor n = Tensor::empty(t->shape(), DType::F64);
    l2norm_forward(Stream::cpu(), n, *t, 1e-6f);
    *t = n;
  }
  const Tensor gr = random_tensor({T, hv}, DType::F64, rng), br = random_tensor({T, hv}, DType::F64, rng);
  in.g = make({T, hv}, [&](int64_t i) { return -0.3 * std::abs(gr.data<double>()[i]) - 0.01; });
  in.beta = make({T, hv}, [&](int64_t i) { return sigmoid(br.data<double>()[i]); });
  return in;
}

// The recurrence written out, per document and value head, in f64.
Tensor direct_rule(const RuleInputs& in, const std::vector<int32_t>& cu, double scale) {
  const int64_t T = in.q.size(0), hk = in.q.size(1), dk = in.q.size(2), hv = in.v.size(1), dv = in.v.size(2);
  Tensor out = Tensor::empty({T, hv, dv}, DType::F64);
  auto Q = [&](int64_t t, int64_t h, int64_t i) { return in.q.data<double>()[(t * hk + h) * dk + i]; };
  auto Kk = [&](int64_t t, int64_t h, int64_t i) { return in.k.data<double>()[(t * hk + h) * dk + i]; };
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int64_t h = 0; h < hv; ++h) {
      const int64_t kh = h / (hv / hk);
      std::vector<std::vector<double>> S(size_t(dk), std::vector<double>(size_t(dv), 0.0));
      for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
        const double decay = std::exp(in.g.data<double>()[t * hv + h]), b = in.beta.data<double>()[t * hv + h];
        for (auto& row : S) {
          for (double& e : row) e *= decay;
        }
        std::vector<double> u(static_cast<size_t>(dv));
        for (int64_t j = 0; j < dv; ++j) {
          double kv = 0;
          for (int64_t i = 0; i < dk; ++i) kv += S[size_t(i)][size_t(j)] * Kk(t, kh, i);
          u[size_t(j)] = b * (in.v.data<double>()[(t * hv + h) * dv + j] - kv);
        }
        for (int64_t i = 0; i < dk; ++i) {
          for (int64_t j = 0; j < dv; ++j) S[size_t(i)][size_t(j)] += Kk(t, kh, i) * u[size_t(j)];
        }
        for (int64_t j = 0; j < dv; ++j) {
          double o = 0;
          for (int64_t i = 0; i < dk; ++i) o += S[size_t(i)][size_t(j)] * scale * Q(t, kh, i);
          out.data<double>()[(t * hv + h) * dv + j] = o;
        }
      }
    }
  }
  return out;
}

// Documents of 1, 5, 70 (across the backward's 64-token checkpoint) and 1 token, then 3.
const std::vector<int32_t> kRuleDocs = {0, 1, 6, 76, 77, 80};

TEST(GatedDelta, RuleForwardMatchesRecurrencePerDocument) {
  Rng rng(5);
  const int64_t T = 80, hk = 2, hv = 4, dk = 5, dv = 3;
  const RuleInputs in = rule_inputs(T, hk, hv, dk, dv, rng);
  const double scale = 1.0 / std::sqrt(double(dk));
  Tensor out = Tensor::empty({T, hv, dv}, DType::F64);
  gated_delta_rule_forward(Stream::cpu(), out, in.q, in.k, in.v, in.g, in.beta, cu_of(kRuleDocs), float(scale));
  EXPECT_LT(testing::max_abs_diff(out, direct_rule(in, kRuleDocs, double(float(scale)))), 1e-13);
  // One document for everything gives other values: the documents really restart.
  gated_delta_rule_forward(Stream::cpu(), out, in.q, in.k, in.v, in.g, in.beta, cu_of({0, 80}), float(scale));
  EXPECT_GT(testing::max_abs_diff(out, direct_rule(in, kRuleDocs, double(float(scale)))), 1e-3);
}

// The rows [begin, end) of each span of t, one after another.
Tensor rows_of(const Tensor& t, const std::vector<std::pair<int64_t, int64_t>>& spans) {
  Shape shape = t.shape();
  shape[0] = 0;
  for (const auto& [begin, end] : spans) shape[0] += end - begin;
  Tensor out = Tensor::empty(shape, t.dtype());
  int64_t at = 0;
  for (const auto& [begin, end] : spans) {
    out.slice(at, at + end - begin).copy_from(t.slice(begin, end));
    at += end - begin;
  }
  return out;
}

TEST(GatedDelta, DecodingStepsGiveTheForwardsBytes) {
  // Two sequences of 7 and 12 tokens: the prefill of their first 4 and 9 tokens keeps each one's state and conv
  // inputs; the remaining tokens one step at a time give the bytes the forward over the whole sequences gives them.
  Rng rng(12);
  const int64_t hk = 2, hv = 4, dk = 5, dv = 3, C = 9, K = 4, capacity = 12;
  const std::vector<int32_t> cu{0, 7, 19}, prompt{4, 9};
  const RuleInputs in = rule_inputs(19, hk, hv, dk, dv, rng);
  const Tensor x = random_tensor({19, C}, DType::F64, rng), w = random_tensor({C, K}, DType::F64, rng);
  const float scale = 0.4f;
  Tensor out = Tensor::empty({19, hv, dv}, DType::F64), y = Tensor::empty({19, C}, DType::F64);
  gated_delta_rule_forward(Stream::cpu(), out, in.q, in.k, in.v, in.g, in.beta, cu_of(cu), scale);
  causal_conv1d_silu_forward(Stream::cpu(), y, x, w, cu_of(cu));

  // The prefill: the prompts as documents.
  const auto prompt_rows = [&](const Tensor& t) { return rows_of(t, {{0, 4}, {7, 16}}); };
  Tensor state = Tensor::empty({2, hv, dk, dv}, DType::F64), prefill_out = Tensor::empty({13, hv, dv}, DType::F64);
  gated_delta_rule_prefill(Stream::cpu(), prefill_out, state, prompt_rows(in.q), prompt_rows(in.k), prompt_rows(in.v),
                           prompt_rows(in.g), prompt_rows(in.beta), cu_of({0, 4, 13}), scale);
  EXPECT_EQ(std::memcmp(prefill_out.slice(0, 4).raw_data(), out.slice(0, 4).raw_data(), 4 * hv * dv * 8), 0);
  EXPECT_EQ(std::memcmp(prefill_out.slice(4, 13).raw_data(), out.slice(7, 16).raw_data(), 9 * hv * dv * 8), 0);
  Tensor history = Tensor::zeros({2, capacity, C}, DType::F64);
  history.select(0).slice(0, 4).copy_from(x.slice(0, 4));
  history.select(1).slice(0, 9).copy_from(x.slice(7, 16));

  // Three steps: token 4 + n of sequence 0 and 9 + n of sequence 1.
  for (int32_t n = 0; n < 3; ++n) {
    const int64_t t0 = 4 + n, t1 = 7 + 9 + n;
    const auto step_rows = [&](const Tensor& t) { return rows_of(t, {{t0, t0 + 1}, {t1, t1 + 1}}); };
    Tensor step_out = Tensor::empty({2, hv, dv}, DType::F64), step_y = Tensor::empty({2, C}, DType::F64);
    gated_delta_rule_decode(Stream::cpu(), step_out, state, step_rows(in.q), step_rows(in.k), step_rows(in.v),
                            step_rows(in.g), step_rows(in.beta), scale);
    history.select(0).slice(4 + n, 5 + n).copy_from(x.slice(t0, t0 + 1));
    history.select(1).slice(9 + n, 10 + n).copy_from(x.slice(t1, t1 + 1));
    causal_conv1d_silu_decode(Stream::cpu(), step_y, history, w, Tensor::from_vector<int32_t>({5 + n, 10 + n}, {2}));
    const Tensor want_out = step_rows(out), want_y = step_rows(y);
    EXPECT_EQ(std::memcmp(step_out.raw_data(), want_out.raw_data(), want_out.nbytes()), 0) << "rule, step " << n;
    EXPECT_EQ(std::memcmp(step_y.raw_data(), want_y.raw_data(), want_y.nbytes()), 0) << "conv, step " << n;
  }
  // Bad shapes and lengths are refused by name.
  Tensor y2 = Tensor::empty({2, C}, DType::F64);
  expect_error(
      [&] {
        causal_conv1d_silu_decode(Stream::cpu(), y2, history, w, cu_of({0, 13}));
      },
      "causal_conv1d_silu_decode: lengths");
  expect_error(
      [&] {
        causal_conv1d_silu_decode(Stream::cpu(), y2, history, w, cu_of({13, 1}));
      },
      "lengths[0] = 13 must be in [1, capacity = 12]");
  Tensor wrong_state = Tensor::empty({2, hv, dk, dv + 1}, DType::F64), o2 = Tensor::empty({2, hv, dv}, DType::F64);
  const Tensor q2 = in.q.slice(0, 2), k2 = in.k.slice(0, 2), v2 = in.v.slice(0, 2), g2 = in.g.slice(0, 2),
               b2 = in.beta.slice(0, 2);
  expect_error([&] { gated_delta_rule_decode(Stream::cpu(), o2, wrong_state, q2, k2, v2, g2, b2, scale); },
               "gated_delta_rule_decode: state");
}

TEST(GatedDelta, RuleBackwardMatchesFiniteDifferences) {
  Rng rng(6);
  const int64_t T = 80, hk = 1, hv = 2, dk = 4, dv = 3;
  RuleInputs in = rule_inputs(T, hk, hv, dk, dv, rng);
  const Tensor up = random_tensor({T, hv, dv}, DType::F64, rng);
  const Tensor cu = cu_of(kRuleDocs);
  const float scale = 0.7f;
  Tensor out = Tensor::empty({T, hv, dv}, DType::F64);
  auto loss = [&] {
    gated_delta_rule_forward(Stream::cpu(), out, in.q, in.k, in.v, in.g, in.beta, cu, scale);
    return testing::dot(out, up);
  };
  Tensor dq = Tensor::empty({T, hk, dk}, DType::F64), dk_ = Tensor::empty({T, hk, dk}, DType::F64);
  Tensor dv_ = Tensor::empty({T, hv, dv}, DType::F64), dg = Tensor::empty({T, hv}, DType::F64);
  Tensor dbeta = Tensor::empty({T, hv}, DType::F64);
  gated_delta_rule_backward(Stream::cpu(), dq, dk_, dv_, dg, dbeta, up, in.q, in.k, in.v, in.g, in.beta, cu, scale);
  testing::expect_gradients_match(
      loss, {{"q", in.q, dq}, {"k", in.k, dk_}, {"v", in.v, dv_}, {"g", in.g, dg}, {"beta", in.beta, dbeta}});
}

TEST(GatedDelta, RuleF32MatchesF64) {
  Rng rng(7);
  const int64_t T = 80, hk = 1, hv = 2, dk = 8, dv = 4;
  const RuleInputs in = rule_inputs(T, hk, hv, dk, dv, rng);
  const Tensor cu = cu_of(kRuleDocs);
  const Tensor up = random_tensor({T, hv, dv}, DType::F64, rng);
  auto run = [&](DType dt, std::vector<Tensor>* grads) {
    const Tensor q = in.q.to(dt), k = in.k.to(dt), v = in.v.to(dt), g = in.g.to(dt), b = in.beta.to(dt);
    Tensor out = Tensor::empty({T, hv, dv}, dt);
    gated_delta_rule_forward(Stream::cpu(), out, q, k, v, g, b, cu, 0.5f);
    *grads = {Tensor::empty({T, hk, dk}, dt), Tensor::empty({T, hk, dk}, dt), Tensor::empty({T, hv, dv}, dt),
              Tensor::empty({T, hv}, dt), Tensor::empty({T, hv}, dt)};
    gated_delta_rule_backward(Stream::cpu(), (*grads)[0], (*grads)[1], (*grads)[2], (*grads)[3], (*grads)[4], up.to(dt),
                              q, k, v, g, b, cu, 0.5f);
    return out;
  };
  std::vector<Tensor> g32, g64;
  const Tensor o32 = run(DType::F32, &g32), o64 = run(DType::F64, &g64);
  // f32 rounding over sums of ~dk terms and 70 recurrent steps: a few 1e-7 relative.
  EXPECT_LT(testing::relative_error(o32.to(DType::F64), o64), 1e-5);
  for (size_t i = 0; i < g32.size(); ++i) EXPECT_LT(testing::relative_error(g32[i].to(DType::F64), g64[i]), 1e-5) << i;
}

TEST(GatedDelta, GatedRmsNormForwardAndBackward) {
  Rng rng(8);
  const int64_t N = 5, D = 6;
  Tensor x = random_tensor({N, D}, DType::F64, rng), z = random_tensor({N, D}, DType::F64, rng);
  Tensor w = random_tensor({D}, DType::F64, rng, 0.5);
  const float eps = 1e-6f;
  Tensor y = Tensor::empty({N, D}, DType::F64), rstd = Tensor::empty({N}, DType::F64);
  gated_rmsnorm_forward(Stream::cpu(), y, rstd, x, z, w, eps);
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += x.data<double>()[n * D + d] * x.data<double>()[n * D + d];
    const double r = 1.0 / std::sqrt(sum / D + double(eps));
    EXPECT_NEAR(rstd.data<double>()[n], r, 1e-14);
    for (int64_t d = 0; d < D; ++d) {
      const double zv = z.data<double>()[n * D + d];
      EXPECT_NEAR(y.data<double>()[n * D + d], w.data<double>()[d] * x.data<double>()[n * D + d] * r * zv * sigmoid(zv),
                  1e-14);
    }
  }
  const Tensor up = random_tensor({N, D}, DType::F64, rng);
  auto loss = [&] {
    gated_rmsnorm_forward(Stream::cpu(), y, rstd, x, z, w, eps);
    return testing::dot(y, up);
  };
  loss();
  Tensor dx = Tensor::empty({N, D}, DType::F64), dz = Tensor::empty({N, D}, DType::F64);
  Tensor dw = Tensor::zeros({D}, DType::F64);
  gated_rmsnorm_backward(Stream::cpu(), dx, dz, dw, up, x, z, w, rstd, eps);
  testing::expect_gradients_match(loss, {{"x", x, dx}, {"z", z, dz}, {"w", w, dw}});
}

// transformers 5.17 (tests/data/gated_delta/make_fixture.py): its gates, l2norm and torch_recurrent_gated_delta_rule
// with Hv = 2 Hk, two sequences packed here as two documents; causal_conv1d_fn; Qwen3_5RMSNormGated. All f32: the
// tolerances are f32 rounding over short sums and 24 recurrent steps (measured ~1e-7).
TEST(GatedDelta, MatchesTransformers) {
  const io::SafetensorsFile file =
      io::SafetensorsFile::open(testing::test_data_path("gated_delta/fixture.safetensors"));
  auto t = [&](const char* name) { return file.tensor(name).clone(); };
  const Tensor q_raw = t("q"), k_raw = t("k"), v4 = t("v");
  const int64_t B = q_raw.size(0), S = q_raw.size(1), hk = q_raw.size(2), dk = q_raw.size(3), hv = v4.size(2),
                dv = v4.size(3), T = B * S;
  const Tensor cu = cu_of({0, int32_t(S), int32_t(2 * S)});
  const Tensor q0 = q_raw.view({T, hk, dk}), k0 = k_raw.view({T, hk, dk}), v = v4.view({T, hv, dv});
  const Tensor a = t("a").view({T, hv}), b = t("b").view({T, hv}), A_log = t("A_log"), dt_bias = t("dt_bias");
  const float eps = 1e-6f, scale = 1.0f / std::sqrt(float(dk));
  Tensor g = Tensor::empty({T, hv}, DType::F32), beta = Tensor::empty({T, hv}, DType::F32);
  gated_delta_gates_forward(Stream::cpu(), g, beta, a, b, A_log, dt_bias);
  EXPECT_LT(testing::relative_error(g, t("g").view({T, hv})), 1e-6);
  EXPECT_LT(testing::relative_error(beta, t("beta").view({T, hv})), 1e-6);
  Tensor q = Tensor::empty({T, hk, dk}, DType::F32), k = Tensor::empty({T, hk, dk}, DType::F32);
  l2norm_forward(Stream::cpu(), q, q0, eps);
  l2norm_forward(Stream::cpu(), k, k0, eps);
  Tensor out = Tensor::empty({T, hv, dv}, DType::F32);
  gated_delta_rule_forward(Stream::cpu(), out, q, k, v, g, beta, cu, scale);
  EXPECT_LT(testing::relative_error(out, t("out").view({T, hv, dv})), 1e-5);
  EXPECT_LT(testing::relative_error(out, t("out_chunk").view({T, hv, dv})), 1e-5);

  const Tensor dout = t("dout").view({T, hv, dv});
  Tensor dq = Tensor::empty({T, hk, dk}, DType::F32), dk_ = Tensor::empty({T, hk, dk}, DType::F32);
  Tensor dv_ = Tensor::empty({T, hv, dv}, DType::F32), dg = Tensor::empty({T, hv}, DType::F32);
  Tensor dbeta = Tensor::empty({T, hv}, DType::F32);
  gated_delta_rule_backward(Stream::cpu(), dq, dk_, dv_, dg, dbeta, dout, q, k, v, g, beta, cu, scale);
  Tensor dq0 = Tensor::empty({T, hk, dk}, DType::F32), dk0 = Tensor::empty({T, hk, dk}, DType::F32);
  l2norm_backward(Stream::cpu(), dq0, dq, q0, eps);
  l2norm_backward(Stream::cpu(), dk0, dk_, k0, eps);
  Tensor da = Tensor::empty({T, hv}, DType::F32), db = Tensor::empty({T, hv}, DType::F32);
  Tensor dA_log = Tensor::zeros({hv}, DType::F32), ddt_bias = Tensor::zeros({hv}, DType::F32);
  gated_delta_gates_backward(Stream::cpu(), da, db, dA_log, ddt_bias, dg, dbeta, a, b, A_log, dt_bias);
  EXPECT_LT(testing::relative_error(dq0, t("dq").view({T, hk, dk})), 1e-5);
  EXPECT_LT(testing::relative_error(dk0, t("dk").view({T, hk, dk})), 1e-5);
  EXPECT_LT(testing::relative_error(dv_, t("dv").view({T, hv, dv})), 1e-5);
  EXPECT_LT(testing::relative_error(da, t("da").view({T, hv})), 1e-5);
  EXPECT_LT(testing::relative_error(db, t("db").view({T, hv})), 1e-5);
  EXPECT_LT(testing::relative_error(dA_log, t("dA_log")), 1e-5);
  EXPECT_LT(testing::relative_error(ddt_bias, t("ddt_bias")), 1e-5);

  // The conv: transformers' x is [B, C, S]; ours [T, C] with one document per sequence.
  const Tensor cx = t("conv_x"), cw = t("conv_w");
  const int64_t C = cx.size(1), K = cw.size(1);
  auto to_tokens = [&](const Tensor& bcs) {
    Tensor r = Tensor::empty({T, C}, DType::F32);
    for (int64_t bb = 0; bb < B; ++bb) {
      for (int64_t c = 0; c < C; ++c) {
        for (int64_t s = 0; s < S; ++s) r.data<float>()[(bb * S + s) * C + c] = bcs.data<float>()[(bb * C + c) * S + s];
      }
    }
    return r;
  };
  const Tensor x = to_tokens(cx);
  Tensor y = Tensor::empty({T, C}, DType::F32);
  causal_conv1d_silu_forward(Stream::cpu(), y, x, cw, cu);
  EXPECT_LT(testing::relative_error(y, to_tokens(t("conv_y"))), 1e-6);
  Tensor dx = Tensor::empty({T, C}, DType::F32), dw = Tensor::zeros({C, K}, DType::F32);
  causal_conv1d_silu_backward(Stream::cpu(), dx, dw, to_tokens(t("conv_dy")), x, cw, cu);
  EXPECT_LT(testing::relative_error(dx, to_tokens(t("conv_dx"))), 1e-6);
  EXPECT_LT(testing::relative_error(dw, t("conv_dw")), 1e-6);

  const Tensor nx = t("norm_x"), nz = t("norm_z"), nw = t("norm_w");
  Tensor ny = Tensor::empty(nx.shape(), DType::F32), rstd = Tensor::empty({nx.size(0)}, DType::F32);
  gated_rmsnorm_forward(Stream::cpu(), ny, rstd, nx, nz, nw, eps);
  EXPECT_LT(testing::relative_error(ny, t("norm_y")), 1e-6);
  Tensor ndx = Tensor::empty(nx.shape(), DType::F32), ndz = Tensor::empty(nx.shape(), DType::F32);
  Tensor ndw = Tensor::zeros(nw.shape(), DType::F32);
  gated_rmsnorm_backward(Stream::cpu(), ndx, ndz, ndw, t("norm_dy"), nx, nz, nw, rstd, eps);
  EXPECT_LT(testing::relative_error(ndx, t("norm_dx")), 1e-5);
  EXPECT_LT(testing::relative_error(ndz, t("norm_dz")), 1e-6);
  EXPECT_LT(testing::relative_error(ndw, t("norm_dw")), 1e-6);
}

TEST(GatedDelta, RefusesBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor x = Tensor::zeros({6, 4}, DType::F32), w = Tensor::zeros({4, 3}, DType::F32);
  const Tensor cu = cu_of({0, 2, 6});
  Tensor y = Tensor::zeros({6, 4}, DType::F32), dw = Tensor::zeros({4, 3}, DType::F32);
  expect_error([&] { causal_conv1d_silu_forward(s, y, x.to(DType::I32), w, cu); }, "expected x in f32 or f64");
  expect_error([&] { causal_conv1d_silu_forward(s, y, Tensor::zeros({6}, DType::F32), w, cu); }, "expected x [T, C]");
  expect_error(
      [&] {
        causal_conv1d_silu_forward(s, y, x, Tensor::zeros({5, 3}, DType::F32), cu);
      },
      "expected w [C = 4, K]");
  expect_error([&] { causal_conv1d_silu_forward(s, y, x, w.to(DType::F64), cu); }, "w");
  expect_error([&] { causal_conv1d_silu_forward(s, Tensor::zeros({6, 5}, DType::F32), x, w, cu); }, "y");
  expect_error([&] { causal_conv1d_silu_forward(s, y, x, w, cu_of({0, 2, 5})); }, "token count 6");
  expect_error([&] { causal_conv1d_silu_forward(s, y, x, w, cu_of({0, 3, 3, 6})); }, "strictly increase");
  expect_error([&] { causal_conv1d_silu_forward(s, y, x, w, cu_of({1, 6})); }, "must be 0");
  expect_error([&] { causal_conv1d_silu_backward(s, y, dw.to(DType::F64), x, x, w, cu); }, "dw");
  expect_error([&] { causal_conv1d_silu_backward(s, y, dw, Tensor::zeros({6, 4}, DType::F64), x, w, cu); }, "dy");

  expect_error([&] { l2norm_forward(s, y, x, -1.0f); }, "expected eps >= 0");
  expect_error([&] { l2norm_forward(s, Tensor::zeros({6, 3}, DType::F32), x, 1e-6f); }, "y");
  expect_error([&] { l2norm_backward(s, y, y, x, 1e-6f); }, "separate memory");

  const Tensor a = Tensor::zeros({6, 2}, DType::F32), h2 = Tensor::zeros({2}, DType::F32);
  Tensor g = Tensor::zeros({6, 2}, DType::F32), beta = Tensor::zeros({6, 2}, DType::F32);
  expect_error([&] { gated_delta_gates_forward(s, g, beta, a, a, Tensor::zeros({3}, DType::F32), h2); }, "A_log");
  expect_error([&] { gated_delta_gates_forward(s, g, beta, a, a, h2, h2.to(DType::F64)); }, "dt_bias");
  expect_error([&] { gated_delta_gates_forward(s, g, beta, a, Tensor::zeros({6, 3}, DType::F32), h2, h2); }, "b");
  expect_error([&] { gated_delta_gates_forward(s, g, beta, Tensor::zeros({6}, DType::F32), a, h2, h2); }, "a [T, H]");
  Tensor dh = Tensor::zeros({2}, DType::F32);
  expect_error([&] { gated_delta_gates_backward(s, g, beta, dh, Tensor::zeros({3}, DType::F32), a, a, a, a, h2, h2); },
               "ddt_bias");

  const Tensor q = Tensor::zeros({6, 2, 4}, DType::F32), v = Tensor::zeros({6, 4, 3}, DType::F32);
  const Tensor gh = Tensor::zeros({6, 4}, DType::F32);
  Tensor out = Tensor::zeros({6, 4, 3}, DType::F32);
  expect_error(
      [&] {
        gated_delta_rule_forward(s, out, q, q, Tensor::zeros({6, 3, 3}, DType::F32), gh, gh, cu, 0.5f);
      },
      "multiple of the key heads");
  expect_error(
      [&] {
        gated_delta_rule_forward(s, out, q, q, Tensor::zeros({5, 4, 3}, DType::F32), gh, gh, cu, 0.5f);
      },
      "expected v [T = 6");
  expect_error(
      [&] {
        gated_delta_rule_forward(s, out, q, Tensor::zeros({6, 2, 5}, DType::F32), v, gh, gh, cu, 0.5f);
      },
      "k");
  expect_error(
      [&] {
        gated_delta_rule_forward(s, out, q, q, v, Tensor::zeros({6, 2}, DType::F32), gh, cu, 0.5f);
      },
      "g");
  expect_error([&] { gated_delta_rule_forward(s, out, q, q, v, gh, gh.to(DType::F64), cu, 0.5f); }, "beta");
  expect_error([&] { gated_delta_rule_forward(s, out, q, q, v, gh, gh, cu, NAN); }, "finite scale");
  expect_error([&] { gated_delta_rule_forward(s, out, q, q, v, gh, gh, cu.to(DType::I64), 0.5f); }, "cu_seqlens");
  expect_error(
      [&] {
        gated_delta_rule_forward(s, Tensor::zeros({6, 4, 2}, DType::F32), q, q, v, gh, gh, cu, 0.5f);
      },
      "out");
  expect_error([&] { gated_delta_rule_forward(s, out, q.to(DType::BF16), q, v, gh, gh, cu, 0.5f); },
               "expected q in f32 or f64");
  Tensor dq = Tensor::zeros({6, 2, 4}, DType::F32);
  expect_error(
      [&] {
        gated_delta_rule_backward(s, dq, dq, out, gh, Tensor::zeros({6, 2}, DType::F32), out, q, q, v, gh, gh, cu,
                                  0.5f);
      },
      "dbeta");

  const Tensor nw = Tensor::zeros({4}, DType::F32);
  Tensor rstd = Tensor::zeros({6}, DType::F32);
  expect_error([&] { gated_rmsnorm_forward(s, y, rstd, x, x, Tensor::zeros({3}, DType::F32), 1e-6f); }, "w");
  expect_error([&] { gated_rmsnorm_forward(s, y, Tensor::zeros({5}, DType::F32), x, x, nw, 1e-6f); }, "rstd");
  expect_error([&] { gated_rmsnorm_forward(s, y, rstd, x, Tensor::zeros({6, 5}, DType::F32), nw, 1e-6f); }, "z");
  expect_error([&] { gated_rmsnorm_forward(s, y, rstd, x, x, nw, INFINITY); }, "expected eps >= 0");
  Tensor dn = Tensor::zeros({4}, DType::F32);
  expect_error([&] { gated_rmsnorm_backward(s, y, y, dn, x, x, x, nw, rstd.to(DType::F64), 1e-6f); }, "rstd");
}

}  // namespace
}  // namespace moetrain::ops
