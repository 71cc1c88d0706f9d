// Tests for ops/activation: SwiGLU and GPT-OSS's clamped SwiGLU, forward against a direct computation, backward
// against finite differences (away from the clamps' kinks), the gradient exactly at and beyond the limits, and
// argument checks; the sigmoid gate (Qwen3.5) with a gate per element and per row, likewise.
#include "ops/activation.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::random_tensor;

void expect_error(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected a moetrain::Error mentioning \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(Swiglu, ForwardMatchesDirectComputation) {
  const int64_t rows = 5, width = 7;
  Rng rng(30);
  const Tensor gate_up = random_tensor({rows, 2 * width}, DType::F32, rng, 3.0);
  Tensor y = Tensor::empty({rows, width}, DType::F32);
  swiglu_forward(Stream::cpu(), y, gate_up);

  const auto gu = gate_up.to_vector<float>();
  std::vector<double> want(static_cast<size_t>(rows * width));
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t j = 0; j < width; ++j) {
      const double g = gu[n * 2 * width + j], u = gu[n * 2 * width + width + j];
      want[n * width + j] = g / (1.0 + std::exp(-g)) * u;  // silu(gate) * up, gate first
    }
  }
  EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, {rows, width})), 1e-6);
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, width = 6;
  Rng rng(31);
  Tensor gate_up = random_tensor({rows, 2 * width}, DType::F64, rng, 2.0);
  const Tensor g = random_tensor({rows, width}, DType::F64, rng);
  Tensor y = Tensor::empty({rows, width}, DType::F64);
  auto loss = [&] {
    swiglu_forward(Stream::cpu(), y, gate_up);
    return testing::dot(y, g);
  };
  Tensor dgate_up = Tensor::empty({rows, 2 * width}, DType::F64);
  swiglu_backward(Stream::cpu(), dgate_up, g, gate_up);
  testing::expect_gradients_match(loss, {{"gate_up", gate_up, dgate_up}});
}

TEST(Swiglu, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor gate_up = Tensor::zeros({3, 8}, DType::F32);
  expect_error(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 4}, DType::F32), Tensor::zeros({3, 7}, DType::F32));
      },
      "expected gate_up [N, 2I] with an even width but found f32[3, 7]");
  expect_error(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 8}, DType::F32), gate_up);
      },
      "swiglu_forward: y [N, I]: expected shape [3, 4] but found [3, 8]");
  expect_error(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 4}, DType::F64), gate_up);
      },
      "swiglu_forward: y [N, I]: expected dtype f32 but found f64");
  expect_error([&] { swiglu_forward(s, Tensor::zeros({4}, DType::F32), Tensor::zeros({8}, DType::F32)); },
               "expected gate_up [N, 2I]");
  expect_error(
      [&] {
        swiglu_backward(s, Tensor::zeros({3, 8}, DType::F32), Tensor::zeros({2, 4}, DType::F32), gate_up);
      },
      "swiglu_backward: dy [N, I]: expected shape [3, 4] but found [2, 4]");
  expect_error(
      [&] {
        swiglu_backward(s, Tensor::zeros({3, 4}, DType::F32), Tensor::zeros({3, 4}, DType::F32), gate_up);
      },
      "swiglu_backward: dgate_up [N, 2I]: expected shape [3, 8] but found [3, 4]");
}

// transformers' GptOssExperts._apply_gate written out in f64: gate clamped above only, up on both sides.
double clamped_glu(double gate, double up, double alpha, double limit) {
  const double g = std::min(gate, limit);
  const double u = std::max(-limit, std::min(up, limit));
  return (u + 1.0) * (g / (1.0 + std::exp(-g * alpha)));
}

TEST(ClampedSwiglu, ForwardMatchesTheTransformersFormula) {
  const int64_t rows = 9, width = 13;
  Rng rng(32);
  for (const ClampedSwigluParams& params : {ClampedSwigluParams{}, ClampedSwigluParams{1.0f, 3.0f}}) {
    for (const DType dtype : {DType::F32, DType::F64}) {
      // N(0, 6^2): about a quarter of the entries lie beyond +-7 (and more beyond +-3), so both clamps act.
      const Tensor gate_up = random_tensor({rows, 2 * width}, dtype, rng, 6.0);
      Tensor y = Tensor::empty({rows, width}, dtype);
      clamped_swiglu_forward(Stream::cpu(), y, gate_up, params);
      const Tensor gu = gate_up.to(DType::F64);
      const double* v = gu.data<double>();
      std::vector<double> want(static_cast<size_t>(rows * width));
      int gate_beyond = 0, up_beyond = 0;
      for (int64_t n = 0; n < rows; ++n) {
        for (int64_t j = 0; j < width; ++j) {
          const double g = v[n * 2 * width + j], u = v[n * 2 * width + width + j];
          gate_beyond += g > params.limit;
          up_beyond += std::abs(u) > params.limit;
          want[static_cast<size_t>(n * width + j)] = clamped_glu(g, u, params.alpha, params.limit);
        }
      }
      EXPECT_GT(gate_beyond, 0);
      EXPECT_GT(up_beyond, 0);
      // f32: a handful of roundings per element (exp within 1 ulp), 1e-6 relative; f64: the same formula.
      const double bound = dtype == DType::F32 ? 1e-6 : 1e-14;
      EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, {rows, width})), bound)
          << dtype_name(dtype) << " limit " << params.limit;
    }
  }
}

TEST(ClampedSwiglu, BackwardMatchesFiniteDifferencesAwayFromTheKinks) {
  const int64_t rows = 6, width = 10;
  Rng rng(33);
  for (const ClampedSwigluParams& params : {ClampedSwigluParams{}, ClampedSwigluParams{0.5f, 2.0f}}) {
    Tensor gate_up = random_tensor({rows, 2 * width}, DType::F64, rng, 2.5 * params.limit / 2.0);
    // Keep every entry at least 0.01 from +-limit, so a step of 1e-6 never crosses a kink.
    double* v = gate_up.data<double>();
    int beyond = 0;
    for (int64_t i = 0; i < gate_up.numel(); ++i) {
      if (std::abs(std::abs(v[i]) - params.limit) < 0.01) v[i] += v[i] > 0 ? 0.02 : -0.02;
      beyond += std::abs(v[i]) > params.limit;
    }
    EXPECT_GT(beyond, 0) << "no entry beyond the limit: the zero-gradient region is untested";
    const Tensor g = random_tensor({rows, width}, DType::F64, rng);
    Tensor y = Tensor::empty({rows, width}, DType::F64);
    auto loss = [&] {
      clamped_swiglu_forward(Stream::cpu(), y, gate_up, params);
      return testing::dot(y, g);
    };
    Tensor dgate_up = Tensor::empty({rows, 2 * width}, DType::F64);
    clamped_swiglu_backward(Stream::cpu(), dgate_up, g, gate_up, params);
    testing::expect_gradients_match(loss, {{"gate_up", gate_up, dgate_up}});
  }
}

// torch 2.15 (the golden reference's, /work/venv-golden) on transformers' GptOssExperts._apply_gate in f64, with
// alpha = 1.702f widened (torch rounds the scalar to f32 for f32 tensors) and dy_j = (j + 1) / 4:
//   gate = [7, 7.5, 20, -7, -20, 1, 1, 1, 1, 7, 6.96875, 1], up = [0.5 x 5, 7, -7, 7.25, -9, 8, 0.5, -6.96875]
//   g = gate.clamp(min=None, max=7); u = up.clamp(min=-7, max=7); y = (u + 1) * (g * sigmoid(g * alpha))
//   y.backward(dy)
// Its clamp backward passes the gradient strictly inside the limits: at exactly 7 (gate) and +-7 (up) it is 0, as
// beyond them; gate has no lower clamp (-7 and -20 pass).
TEST(ClampedSwiglu, MatchesTorchAtAndBeyondTheLimits) {
  const std::vector<double> gate{7.0, 7.5, 20.0, -7.0, -20.0, 1.0, 1.0, 1.0, 1.0, 7.0, 6.96875, 1.0};
  const std::vector<double> up{0.5, 0.5, 0.5, 0.5, 0.5, 7.0, -7.0, 7.25, -9.0, 8.0, 0.5, -6.96875};
  const std::vector<double> torch_y{10.49992969246577,      10.49992969246577,       10.49992969246577,
                                    -7.030753422914545e-05, -4.9401131949194083e-14, 6.7663661503490875,
                                    -5.074774612761816,     6.7663661503490875,      -5.074774612761816,
                                    55.99962502648411,      10.453051182796061,      -5.048343494987014};
  const std::vector<double> torch_dgate{0.0,
                                        0.0,
                                        0.0,
                                        -0.00010961869007787603,
                                        -1.020133388295726e-13,
                                        12.813355306926367,
                                        -11.21168589356057,
                                        17.084473742568488,
                                        -14.415024720292163,
                                        0.0,
                                        4.125316369328692,
                                        -19.119928622054186};
  const std::vector<double> torch_dup{1.7499882820776285,
                                      3.499976564155257,
                                      5.249964846232885,
                                      -4.6871689486096966e-05,
                                      -4.116760995766173e-14,
                                      0.0,
                                      0.0,
                                      0.0,
                                      0.0,
                                      0.0,
                                      19.163927168459445,
                                      2.537387306380908};
  const int64_t n = static_cast<int64_t>(gate.size());
  std::vector<double> gu = gate;
  gu.insert(gu.end(), up.begin(), up.end());
  const Tensor gate_up = Tensor::from_vector(gu, {1, 2 * n});  // one row: gate in [0, n), up in [n, 2n)
  std::vector<double> dyv(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) dyv[static_cast<size_t>(j)] = 0.25 * static_cast<double>(j + 1);
  const Tensor dy = Tensor::from_vector(dyv, {1, n});
  for (const DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor y = Tensor::empty({1, n}, dtype);
    clamped_swiglu_forward(Stream::cpu(), y, gate_up.to(dtype), {});
    Tensor d = Tensor::empty({1, 2 * n}, dtype);
    clamped_swiglu_backward(Stream::cpu(), d, dy.to(dtype), gate_up.to(dtype), {});
    const std::vector<double> yv = y.to(DType::F64).to_vector<double>();
    const std::vector<double> dv = d.to(DType::F64).to_vector<double>();
    // f64: the same formula up to the order of a few roundings; f32: a handful of roundings (exp within 1 ulp).
    const double bound = dtype == DType::F32 ? 1e-6 : 1e-13;
    for (size_t j = 0; j < static_cast<size_t>(n); ++j) {
      EXPECT_NEAR(yv[j], torch_y[j], bound * std::abs(torch_y[j])) << "y column " << j;
      EXPECT_NEAR(dv[j], torch_dgate[j], bound * std::abs(torch_dgate[j])) << "dgate column " << j;
      EXPECT_NEAR(dv[static_cast<size_t>(n) + j], torch_dup[j], bound * std::abs(torch_dup[j])) << "dup column " << j;
      // Exactly 0 where torch's is (at or beyond a limit), non-zero elsewhere.
      EXPECT_EQ(dv[j] == 0.0, torch_dgate[j] == 0.0) << "dgate column " << j;
      EXPECT_EQ(dv[static_cast<size_t>(n) + j] == 0.0, torch_dup[j] == 0.0) << "dup column " << j;
    }
    // Beyond the limit the output is that at the limit, bit for bit (the same clamped operands).
    EXPECT_EQ(yv[1], yv[0]);
    EXPECT_EQ(yv[2], yv[0]);
    EXPECT_EQ(yv[7], yv[5]);
    EXPECT_EQ(yv[8], yv[6]);
  }
}

TEST(ClampedSwiglu, BackwardInPlaceOverGateUpMatches) {
  Rng rng(34);
  const Tensor gate_up = random_tensor({5, 18}, DType::F32, rng, 6.0);
  const Tensor dy = random_tensor({5, 9}, DType::F32, rng);
  Tensor separate = Tensor::empty({5, 18}, DType::F32);
  clamped_swiglu_backward(Stream::cpu(), separate, dy, gate_up, {});
  Tensor in_place = gate_up.clone();
  clamped_swiglu_backward(Stream::cpu(), in_place, dy, in_place, {});
  EXPECT_EQ(in_place.to_vector<float>(), separate.to_vector<float>());
}

TEST(ClampedSwiglu, RejectsBadParamsAndArguments) {
  Stream& s = Stream::cpu();
  const Tensor gate_up = Tensor::zeros({3, 8}, DType::F32);
  Tensor y = Tensor::zeros({3, 4}, DType::F32);
  Tensor dgate_up = Tensor::zeros({3, 8}, DType::F32);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto refused = [&](const ClampedSwigluParams& params, const std::string& text) {
    expect_error([&] { clamped_swiglu_forward(s, y, gate_up, params); }, "clamped_swiglu_forward: " + text);
    expect_error([&] { clamped_swiglu_backward(s, dgate_up, y, gate_up, params); }, "clamped_swiglu_backward: " + text);
  };
  refused({nan, 7.0f}, "alpha (nan) must be finite");
  refused({inf, 7.0f}, "alpha (inf) must be finite");
  refused({1.702f, 0.0f}, "limit (0) must be finite and > 0");
  refused({1.702f, -7.0f}, "limit (-7) must be finite and > 0");
  refused({1.702f, nan}, "limit (nan) must be finite and > 0");
  refused({1.702f, inf}, "limit (inf) must be finite and > 0");
  expect_error(
      [&] {
        clamped_swiglu_forward(s, y, Tensor::zeros({3, 7}, DType::F32), {});
      },
      "clamped_swiglu_forward: expected gate_up [N, 2I] with an even width but found f32[3, 7]");
  expect_error(
      [&] {
        clamped_swiglu_forward(s, Tensor::zeros({3, 8}, DType::F32), gate_up, {});
      },
      "clamped_swiglu_forward: y [N, I]: expected shape [3, 4] but found [3, 8]");
  expect_error([&] { clamped_swiglu_forward(s, y, gate_up.to(DType::I32), {}); },
               "clamped_swiglu_forward: expected gate_up in f32 or f64");
  expect_error(
      [&] {
        clamped_swiglu_backward(s, dgate_up, Tensor::zeros({3, 4}, DType::F64), gate_up, {});
      },
      "clamped_swiglu_backward: dy [N, I]: expected dtype f32 but found f64");
  expect_error([&] { clamped_swiglu_backward(s, y, y, gate_up, {}); },
               "clamped_swiglu_backward: dgate_up [N, 2I]: expected shape [3, 8] but found [3, 4]");
  // A negative alpha is finite and accepted (only finiteness is required of it).
  clamped_swiglu_forward(s, y, gate_up, {-1.0f, 7.0f});
}

// y = x * sigmoid(gate) for a gate per element and a gate per row (broadcast over the row).
TEST(SigmoidGate, ForwardMatchesDirectComputation) {
  const int64_t rows = 5, width = 7;
  for (const int64_t gate_width : {width, int64_t{1}}) {
    SCOPED_TRACE(gate_width);
    Rng rng(40);
    const Tensor x = random_tensor({rows, width}, DType::F32, rng);
    const Tensor gate = random_tensor({rows, gate_width}, DType::F32, rng, 3.0);
    Tensor y = Tensor::empty({rows, width}, DType::F32);
    sigmoid_gate_forward(Stream::cpu(), y, x, gate);
    const auto xv = x.to_vector<float>(), gv = gate.to_vector<float>();
    std::vector<double> want(static_cast<size_t>(rows * width));
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t j = 0; j < width; ++j) {
        const double g = gv[n * gate_width + (gate_width == 1 ? 0 : j)];
        want[n * width + j] = xv[n * width + j] / (1.0 + std::exp(-g));
      }
    EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, {rows, width})), 1e-6);
  }
}

TEST(SigmoidGate, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, width = 6;
  for (const int64_t gate_width : {width, int64_t{1}}) {
    SCOPED_TRACE(gate_width);
    Rng rng(41);
    Tensor x = random_tensor({rows, width}, DType::F64, rng);
    Tensor gate = random_tensor({rows, gate_width}, DType::F64, rng, 2.0);
    const Tensor dy = random_tensor({rows, width}, DType::F64, rng);
    Tensor y = Tensor::empty({rows, width}, DType::F64);
    auto loss = [&] {
      sigmoid_gate_forward(Stream::cpu(), y, x, gate);
      return testing::dot(y, dy);
    };
    Tensor dx = Tensor::empty({rows, width}, DType::F64), dgate = Tensor::empty({rows, gate_width}, DType::F64);
    sigmoid_gate_backward(Stream::cpu(), dx, dgate, dy, x, gate);
    testing::expect_gradients_match(loss, {{"x", x, dx}, {"gate", gate, dgate}});
  }
}

TEST(SigmoidGate, BackwardMayOverwriteDy) {
  Rng rng(42);
  const Tensor x = random_tensor({3, 5}, DType::F32, rng), gate = random_tensor({3, 5}, DType::F32, rng);
  const Tensor dy = random_tensor({3, 5}, DType::F32, rng);
  Tensor dx = Tensor::empty({3, 5}, DType::F32), dgate = Tensor::empty({3, 5}, DType::F32);
  sigmoid_gate_backward(Stream::cpu(), dx, dgate, dy, x, gate);
  Tensor in_place = dy.clone(), dgate2 = Tensor::empty({3, 5}, DType::F32);
  sigmoid_gate_backward(Stream::cpu(), in_place, dgate2, in_place, x, gate);
  EXPECT_EQ(in_place.to_vector<float>(), dx.to_vector<float>());
  EXPECT_EQ(dgate2.to_vector<float>(), dgate.to_vector<float>());
}

TEST(SigmoidGate, RejectsBadArguments) {
  const Tensor x = Tensor::zeros({3, 4}, DType::F32);
  Tensor y = Tensor::zeros({3, 4}, DType::F32);
  expect_error(
      [&] {
        sigmoid_gate_forward(Stream::cpu(), y, x, Tensor::zeros({3, 2}, DType::F32));
      },
      "expected gate [N, D] or [N, 1]");
  expect_error(
      [&] {
        sigmoid_gate_forward(Stream::cpu(), y, x, Tensor::zeros({2, 1}, DType::F32));
      },
      "expected gate [N, D] or [N, 1]");
  expect_error(
      [&] {
        sigmoid_gate_forward(Stream::cpu(), y, x, Tensor::zeros({3, 4}, DType::F64));
      },
      "gate [N, D] or [N, 1]");
  expect_error(
      [&] { sigmoid_gate_forward(Stream::cpu(), y, Tensor::zeros({12}, DType::F32), Tensor::zeros({12}, DType::F32)); },
      "expected x [N, D]");
  expect_error(
      [&] {
        sigmoid_gate_forward(Stream::cpu(), Tensor::zeros({3, 4}, DType::BF16), Tensor::zeros({3, 4}, DType::BF16),
                             Tensor::zeros({3, 4}, DType::BF16));
      },
      "expected x in f32 or f64");
  Tensor y_short = Tensor::zeros({3, 3}, DType::F32);
  expect_error([&] { sigmoid_gate_forward(Stream::cpu(), y_short, x, Tensor::zeros({3, 1}, DType::F32)); }, "y [N, D]");
  Tensor dx = Tensor::zeros({3, 4}, DType::F32), dgate = Tensor::zeros({3, 4}, DType::F32);
  expect_error(
      [&] {
        sigmoid_gate_backward(Stream::cpu(), dx, dgate, x, x, Tensor::zeros({3, 1}, DType::F32));
      },
      "dgate (gate's shape)");
  expect_error(
      [&] {
        sigmoid_gate_backward(Stream::cpu(), dx, dgate, Tensor::zeros({3, 5}, DType::F32), x, dgate);
      },
      "dy [N, D]");
}

}  // namespace
}  // namespace moetrain::ops
