// Tests for ops/rope: HF's default inv_freq, the forward against a direct computation and hand cases (position 0,
// partial rotary, rotated dims inside the head, interleaved vs rotate_half pairs), the backward against finite
// differences, in-place use and argument checks.
#include "ops/rope.h"

#include <cmath>
#include <cstring>
#include <functional>
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

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

RopeParams custom_params(std::vector<float> inv_freq, bool interleaved, float scaling = 1.0f) {
  RopeParams p;
  p.rotary_dim = static_cast<int>(inv_freq.size()) * 2;
  p.interleaved = interleaved;
  p.attention_scaling = scaling;
  p.inv_freq = std::move(inv_freq);
  return p;
}

TEST(Rope, DefaultInvFreqFollowsHf) {
  // theta = 10^4, rotary_dim 8: exponents 0, 1/4, 1/2, 3/4 give 1, 1/10, 1/100, 1/1000 (each rounded to f32).
  EXPECT_EQ(rope_default_params(8, 10000.0).inv_freq, (std::vector<float>{1.0f, 0.1f, 0.01f, 0.001f}));
  const RopeParams p = rope_default_params(128, 1e6);
  EXPECT_EQ(p.rotary_dim, 128);
  EXPECT_FALSE(p.interleaved);
  EXPECT_EQ(p.attention_scaling, 1.0f);
  ASSERT_EQ(p.inv_freq.size(), 64u);
  for (int i = 0; i < 64; ++i) {
    const double want = 1.0 / std::pow(1e6, 2.0 * i / 128.0);
    EXPECT_NEAR(p.inv_freq[i] / want, 1.0, 1e-6) << "i = " << i;
  }
}

TEST(Rope, ForwardMatchesDirectComputation) {
  const int64_t tokens = 5, heads = 3, head_dim = 12;
  const std::vector<int32_t> positions{0, 7, 3, 100, 2};
  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "rotate_half");
    RopeParams params = rope_default_params(8, 10000.0);
    params.interleaved = interleaved;
    params.attention_scaling = 1.25f;
    Rng rng(20);
    const Tensor x = random_tensor({tokens, heads, head_dim}, DType::F32, rng);
    Tensor y = Tensor::empty(x.shape(), DType::F32);
    rope_forward(Stream::cpu(), y, x, Tensor::from_vector(positions, {tokens}), params);

    const auto xv = x.to_vector<float>();
    std::vector<double> want(xv.begin(), xv.end());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (t * heads + h) * head_dim;
        for (int i = 0; i < 4; ++i) {
          const float angle = static_cast<float>(positions[t]) * params.inv_freq[i];  // f32, as HF
          const double c = std::cos(double(angle)) * 1.25, s = std::sin(double(angle)) * 1.25;
          const int64_t ia = base + (interleaved ? 2 * i : i), ib = base + (interleaved ? 2 * i + 1 : i + 4);
          want[ia] = xv[ia] * c - xv[ib] * s;
          want[ib] = xv[ib] * c + xv[ia] * s;
        }
      }
    }
    EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, x.shape())), 1e-6);
  }
}

TEST(Rope, PositionZeroIsIdentity) {
  Rng rng(21);
  const Tensor x = random_tensor({4, 2, 16}, DType::F32, rng);
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  rope_forward(Stream::cpu(), y, x, Tensor::zeros({4}, DType::I32), rope_default_params(16, 1e6));
  EXPECT_TRUE(bitwise_equal(y, x));
}

TEST(Rope, PartialRotaryLeavesTailDimsUnchanged) {
  Rng rng(22);
  const Tensor x = random_tensor({3, 2, 10}, DType::F32, rng);
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  rope_forward(Stream::cpu(), y, x, Tensor::from_vector<int32_t>({5, 9, 1}, {3}), rope_default_params(4, 10000.0));
  const auto xv = x.to_vector<float>(), yv = y.to_vector<float>();
  int changed = 0;
  for (int64_t row = 0; row < 6; ++row) {
    for (int64_t d = 0; d < 10; ++d) {
      if (d >= 4) {
        EXPECT_EQ(yv[row * 10 + d], xv[row * 10 + d]) << "row " << row << " dim " << d;
      } else {
        changed += yv[row * 10 + d] != xv[row * 10 + d];
      }
    }
  }
  EXPECT_GT(changed, 0);  // the rotated dims did move
}

// DeepSeek-V2's queries hold their rope dims after the nope dims of each head: a rotation that starts at
// first_rotated_dim gives those dims the bits of rotating them alone, copies the others, and in place leaves them.
TEST(Rope, RotatedDimsMayStartInsideTheHead) {
  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "rotate_half");
    Rng rng(25);
    constexpr int64_t kTokens = 5, kHeads = 3, kHeadDim = 14, kFirst = 6, kRotary = 6;
    const Tensor x = random_tensor({kTokens, kHeads, kHeadDim}, DType::F32, rng);
    const Tensor positions = Tensor::from_vector<int32_t>({0, 3, 11, 2, 40}, {kTokens});
    RopeParams params = rope_default_params(kRotary, 100.0);
    params.interleaved = interleaved;
    params.attention_scaling = 1.1f;
    RopeParams offset = params;
    offset.first_rotated_dim = kFirst;
    // The rotated dims alone, as a [T, heads, rotary] tensor.
    const auto xv = x.to_vector<float>();
    std::vector<float> slice;
    for (int64_t row = 0; row < kTokens * kHeads; ++row) {
      for (int64_t d = kFirst; d < kFirst + kRotary; ++d) slice.push_back(xv[row * kHeadDim + d]);
    }
    for (bool backward : {false, true}) {
      const auto rotate = backward ? rope_backward : rope_forward;
      Tensor alone = Tensor::empty({kTokens, kHeads, kRotary}, DType::F32);
      rotate(Stream::cpu(), alone, Tensor::from_vector(slice, {kTokens, kHeads, kRotary}), positions, params);
      Tensor y = Tensor::empty(x.shape(), DType::F32);
      rotate(Stream::cpu(), y, x, positions, offset);
      Tensor in_place = x.clone();
      rotate(Stream::cpu(), in_place, in_place, positions, offset);
      EXPECT_TRUE(bitwise_equal(in_place, y));
      const auto yv = y.to_vector<float>(), av = alone.to_vector<float>();
      for (int64_t row = 0; row < kTokens * kHeads; ++row) {
        for (int64_t d = 0; d < kHeadDim; ++d) {
          const bool rotated = d >= kFirst && d < kFirst + kRotary;
          const float want = rotated ? av[row * kRotary + d - kFirst] : xv[row * kHeadDim + d];
          ASSERT_EQ(yv[row * kHeadDim + d], want)
              << (backward ? "backward" : "forward") << " row " << row << " dim " << d;
        }
      }
    }
  }
}

TEST(Rope, InterleavedAndRotateHalfRotateDifferentPairs) {
  // x = [1, 2, 3, 4] at position 2 with inv_freq {1/2, 1/4}: angles 1 and 1/2.
  const Tensor x = Tensor::from_vector<float>({1, 2, 3, 4}, {1, 1, 4});
  const Tensor position = Tensor::from_vector<int32_t>({2}, {1});
  const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.5), s1 = std::sin(0.5);

  Tensor y = Tensor::empty({1, 1, 4}, DType::F32);
  rope_forward(Stream::cpu(), y, x, position, custom_params({0.5f, 0.25f}, false));
  // rotate_half: pairs (0, 2) at angle 1 and (1, 3) at angle 1/2.
  const std::vector<double> half{1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1};
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(y.to_vector<float>()[d], half[d], 1e-6) << "rotate_half dim " << d;

  rope_forward(Stream::cpu(), y, x, position, custom_params({0.5f, 0.25f}, true));
  // interleaved: pairs (0, 1) at angle 1 and (2, 3) at angle 1/2.
  const std::vector<double> inter{1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1, 4 * c1 + 3 * s1};
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(y.to_vector<float>()[d], inter[d], 1e-6) << "interleaved dim " << d;
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "rotate_half");
    Rng rng(23);
    Tensor x = random_tensor({3, 2, 10}, DType::F64, rng);
    const Tensor g = random_tensor({3, 2, 10}, DType::F64, rng);
    const Tensor positions = Tensor::from_vector<int32_t>({4, 0, 17}, {3});
    RopeParams params = rope_default_params(6, 100.0);
    params.interleaved = interleaved;
    params.attention_scaling = 1.3f;
    Tensor y = Tensor::empty(x.shape(), DType::F64);
    auto loss = [&] {
      rope_forward(Stream::cpu(), y, x, positions, params);
      return testing::dot(y, g);
    };
    Tensor dx = Tensor::empty(x.shape(), DType::F64);
    rope_backward(Stream::cpu(), dx, g, positions, params);
    testing::expect_gradients_match(loss, {{"x", x, dx}});
  }
}

TEST(Rope, OutputMayOverwriteInput) {
  Rng rng(24);
  const Tensor x = random_tensor({4, 3, 8}, DType::F32, rng);
  const Tensor positions = Tensor::from_vector<int32_t>({3, 1, 4, 1}, {4});
  const RopeParams params = rope_default_params(8, 10000.0);
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  rope_forward(Stream::cpu(), y, x, positions, params);
  Tensor in_place = x.clone();
  rope_forward(Stream::cpu(), in_place, in_place, positions, params);
  EXPECT_TRUE(bitwise_equal(in_place, y));

  Tensor dx = Tensor::empty(x.shape(), DType::F32);
  rope_backward(Stream::cpu(), dx, x, positions, params);
  Tensor dx_in_place = x.clone();
  rope_backward(Stream::cpu(), dx_in_place, dx_in_place, positions, params);
  EXPECT_TRUE(bitwise_equal(dx_in_place, dx));
}

TEST(Rope, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor x = Tensor::zeros({2, 3, 8}, DType::F32);
  Tensor y = Tensor::zeros({2, 3, 8}, DType::F32);
  const Tensor positions = Tensor::from_vector<int32_t>({0, 1}, {2});
  const RopeParams params = rope_default_params(8, 10000.0);

  RopeParams odd = params;
  odd.rotary_dim = 7;
  expect_error([&] { rope_forward(s, y, x, positions, odd); }, "expected an even rotary_dim > 0 but found 7");
  expect_error([&] { rope_default_params(5, 10000.0); }, "expected an even rotary_dim > 0 but found 5");
  expect_error([&] { rope_forward(s, y, x, positions, rope_default_params(10, 10000.0)); },
               "rotary_dim (10) exceeds the head dim (8)");
  RopeParams past_the_head = params;
  past_the_head.first_rotated_dim = 2;
  expect_error([&] { rope_forward(s, y, x, positions, past_the_head); },
               "the rotated dims [2, 10) (first_rotated_dim 2, rotary_dim 8) do not fit the head dim (8)");
  past_the_head.first_rotated_dim = -2;
  expect_error([&] { rope_backward(s, y, x, positions, past_the_head); }, "first_rotated_dim -2");
  RopeParams short_freq = params;
  short_freq.inv_freq.pop_back();
  expect_error([&] { rope_forward(s, y, x, positions, short_freq); },
               "expected rotary_dim / 2 = 4 inv_freq values but found 3");
  expect_error(
      [&] {
        rope_forward(s, y, x, Tensor::from_vector<int64_t>({0, 1}, {2}), params);
      },
      "rope_forward: position_ids: expected dtype i32 but found i64");
  expect_error(
      [&] {
        rope_forward(s, y, x, Tensor::from_vector<int32_t>({0, 1, 2}, {3}), params);
      },
      "rope_forward: position_ids: expected shape [2] but found [3]");
  expect_error(
      [&] {
        rope_forward(s, y, x, Tensor::from_vector<int32_t>({0, -3}, {2}), params);
      },
      "position_ids[1] is -3");
  expect_error(
      [&] {
        rope_forward(s, Tensor::zeros({2, 3, 8}, DType::F64), x, positions, params);
      },
      "rope_forward: y: expected dtype f32 but found f64");
  expect_error(
      [&] {
        rope_forward(s, Tensor::zeros({2, 8}, DType::F32), Tensor::zeros({2, 8}, DType::F32), positions, params);
      },
      "expected x [T, heads, hd]");
  expect_error(
      [&] {
        rope_backward(s, Tensor::zeros({2, 3, 6}, DType::F32), x, positions, params);
      },
      "rope_backward: dx: expected shape [2, 3, 8] but found [2, 3, 6]");
}

}  // namespace
}  // namespace moetrain::ops
