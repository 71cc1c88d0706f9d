// Tests for ops/norm_rope (the q/k norm followed by rope, fused) on the CPU: the forward and the backward give the
// bits of the ops they fuse, the input and weight gradients against finite differences of the composed forward (f64),
// and argument checks. Also the fused gradient sums of the other
// ops that take an addend in their pass: the norm's input gradient plus the residual's (rmsnorm_backward_input_add)
// and an input gradient added into dx by its GEMM (linear_backward_input_accumulate), each against the op followed by
// accumulate, bit for bit.
#include "ops/norm_rope.h"

#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::expect_error;
using testing::random_tensor;
using testing::same_bytes;

// Positions of two packed documents (5 and 3 tokens): they restart at the boundary.
Tensor packed_positions() { return Tensor::from_vector<int32_t>({0, 1, 2, 3, 4, 0, 1, 2}, {8}); }

struct NormRopeCase {
  int64_t head_dim;
  RopeParams rope;
  bool zero_centered;
};

std::vector<NormRopeCase> cases() {
  RopeParams interleaved = rope_default_params(16, 10000.0);
  interleaved.interleaved = true;
  return {{16, rope_default_params(16, 10000.0), false},
          {16, rope_default_params(16, 10000.0), true},
          {12, rope_default_params(4, 1e6), false},  // partial rotary
          {16, interleaved, false}};
}

TEST(NormRope, ForwardAndBackwardGiveTheBitsOfTheOpsTheyFuse) {
  Stream& s = Stream::cpu();
  const Tensor positions = packed_positions();
  for (const NormRopeCase& c : cases()) {
    SCOPED_TRACE(::testing::Message() << "hd " << c.head_dim << " rotary " << c.rope.rotary_dim
                                      << (c.rope.interleaved ? " interleaved" : "") << (c.zero_centered ? " zc" : ""));
    Rng rng(71);
    const Shape shape{8, 3, c.head_dim};
    const Tensor x = random_tensor(shape, DType::F32, rng, 2.0);
    const Tensor w = random_tensor({c.head_dim}, DType::F32, rng, 0.5);
    const Tensor d_rotated = random_tensor(shape, DType::F32, rng);
    const RmsNormParams norm{1e-6f, c.zero_centered};

    Tensor y = Tensor::empty(shape, DType::F32), rstd = Tensor::empty({24}, DType::F32);
    rmsnorm_rope_forward(s, y, rstd, x, w, norm, positions, c.rope);
    Tensor want_y = Tensor::empty(shape, DType::F32), want_rstd = Tensor::empty({24}, DType::F32);
    rmsnorm_forward(s, want_y, want_rstd, x, w, norm);
    rope_forward(s, want_y, want_y, positions, c.rope);
    EXPECT_TRUE(same_bytes(y, want_y));
    EXPECT_TRUE(same_bytes(rstd, want_rstd));

    const Tensor dw0 = random_tensor({c.head_dim}, DType::F32, rng);
    Tensor dx = Tensor::empty(shape, DType::F32), dw = dw0.clone();
    rope_rmsnorm_backward(s, dx, dw, d_rotated, x, w, rstd, norm, positions, c.rope);
    Tensor want_dx = Tensor::empty(shape, DType::F32), want_d_normed = Tensor::empty(shape, DType::F32);
    Tensor want_dw = dw0.clone();
    rope_backward(s, want_d_normed, d_rotated, positions, c.rope);
    rmsnorm_backward_input(s, want_dx, want_d_normed, x, w, rstd, norm);
    rmsnorm_backward_weight(s, want_dw, want_d_normed, x, rstd);
    EXPECT_TRUE(same_bytes(dx, want_dx));
    EXPECT_TRUE(same_bytes(dw, want_dw));
  }
}

TEST(NormRope, GradientsMatchFiniteDifferences) {
  Stream& s = Stream::cpu();
  const Tensor positions = packed_positions();
  for (const NormRopeCase& c : cases()) {
    SCOPED_TRACE(::testing::Message() << "hd " << c.head_dim << " rotary " << c.rope.rotary_dim);
    Rng rng(72);
    const Shape shape{8, 2, c.head_dim};
    Tensor x = random_tensor(shape, DType::F64, rng, 2.0);
    Tensor w = random_tensor({c.head_dim}, DType::F64, rng, 0.5);
    const Tensor g = random_tensor(shape, DType::F64, rng);  // the loss is sum(y * g): dL/dy = g
    const RmsNormParams norm{1e-6f, c.zero_centered};
    Tensor y = Tensor::empty(shape, DType::F64), rstd = Tensor::empty({16}, DType::F64);
    const auto loss = [&] {
      rmsnorm_rope_forward(s, y, rstd, x, w, norm, positions, c.rope);
      return testing::dot(y, g);
    };
    loss();
    Tensor dx = Tensor::empty(shape, DType::F64), dw = Tensor::zeros({c.head_dim}, DType::F64);
    rope_rmsnorm_backward(s, dx, dw, g, x, w, rstd, norm, positions, c.rope);
    testing::expect_gradients_match(loss, {{"x", x, dx}, {"w", w, dw}});
  }
}

TEST(NormRope, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor positions = packed_positions();
  const RopeParams rope = rope_default_params(16, 10000.0);
  const RmsNormParams norm;
  const Tensor x = Tensor::zeros({8, 2, 16}, DType::F32);
  const Tensor w = Tensor::zeros({16}, DType::F32);
  Tensor rstd = Tensor::zeros({16}, DType::F32);
  Tensor y = Tensor::zeros({8, 2, 16}, DType::F32);
  expect_error([&] { rmsnorm_rope_forward(s, y, rstd, x, w, norm, Tensor::zeros({7}, DType::I32), rope); },
               "rmsnorm_rope_forward: position_ids");
  expect_error([&] { rmsnorm_rope_forward(s, y, Tensor::zeros({15}, DType::F32), x, w, norm, positions, rope); },
               "rmsnorm_rope_forward: expected rstd with N = 16");
  expect_error([&] { rmsnorm_rope_forward(s, y, rstd, x, w, norm, positions, rope_default_params(32, 10000.0)); },
               "rotary_dim (32) exceeds the head dim (16)");
  const Tensor flat = Tensor::zeros({8, 32}, DType::F32);
  const Tensor flat_w = Tensor::zeros({32}, DType::F32);
  expect_error(
      [&] {
        rmsnorm_rope_forward(s, flat.clone(), Tensor::zeros({8}, DType::F32), flat, flat_w, norm, positions, rope);
      },
      "expected x [T, heads, hd]");

  Tensor d_rotated = Tensor::zeros({8, 2, 16}, DType::F32);
  Tensor dx = Tensor::zeros({8, 2, 16}, DType::F32);
  Tensor dw = Tensor::zeros({16}, DType::F32);
  expect_error([&] { rope_rmsnorm_backward(s, d_rotated, dw, d_rotated, x, w, rstd, norm, positions, rope); },
               "rope_rmsnorm_backward: expected dx");
  expect_error(
      [&] {
        rope_rmsnorm_backward(s, dx, Tensor::zeros({8}, DType::F32), d_rotated, x, w, rstd, norm, positions, rope);
      },
      "rope_rmsnorm_backward: dw");
  expect_error(
      [&] {
        rope_rmsnorm_backward(s, dx, dw, Tensor::zeros({8, 2, 16}, DType::F64), x, w, rstd, norm, positions, rope);
      },
      "rope_rmsnorm_backward: dx");
}

TEST(RmsNormBackwardInputAdd, GivesTheBitsOfTheInputGradientThenAccumulate) {
  Stream& s = Stream::cpu();
  for (bool zero_centered : {false, true}) {
    Rng rng(73);
    const Tensor x = random_tensor({6, 40}, DType::F32, rng, 2.0);
    const Tensor w = random_tensor({40}, DType::F32, rng, 0.5);
    const Tensor dy = random_tensor({6, 40}, DType::F32, rng);
    const Tensor addend = random_tensor({6, 40}, DType::F32, rng);
    const RmsNormParams norm{1e-6f, zero_centered};
    Tensor y = Tensor::empty({6, 40}, DType::F32), rstd = Tensor::empty({6}, DType::F32);
    rmsnorm_forward(s, y, rstd, x, w, norm);
    Tensor got = Tensor::empty({6, 40}, DType::F32);
    rmsnorm_backward_input_add(s, got, dy, x, w, rstd, norm, addend);
    Tensor want = Tensor::empty({6, 40}, DType::F32);
    rmsnorm_backward_input(s, want, dy, x, w, rstd, norm);
    accumulate(s, want, addend);
    EXPECT_TRUE(same_bytes(got, want));
    // dx over dy is allowed, as for rmsnorm_backward_input.
    Tensor over_dy = dy.clone();
    rmsnorm_backward_input_add(s, over_dy, over_dy, x, w, rstd, norm, addend);
    EXPECT_TRUE(same_bytes(over_dy, want));
  }
}

TEST(RmsNormBackwardInputAdd, RejectsAnAddendItCannotTake) {
  Stream& s = Stream::cpu();
  Rng rng(75);
  const Tensor x = random_tensor({4, 8}, DType::F32, rng);
  const Tensor w = random_tensor({8}, DType::F32, rng);
  const Tensor rstd = random_tensor({4}, DType::F32, rng);
  const Tensor dy = random_tensor({4, 8}, DType::F32, rng);
  Tensor dx = Tensor::zeros({4, 8}, DType::F32);
  expect_error([&] { rmsnorm_backward_input_add(s, dx, dy, x, w, rstd, {}, dx); }, "apart from dx");
  expect_error(
      [&] {
        rmsnorm_backward_input_add(s, dx, dy, x, w, rstd, {}, Tensor::zeros({4, 7}, DType::F32));
      },
      "rmsnorm_backward_input_add: addend");
  expect_error(
      [&] {
        rmsnorm_backward_input_add(s, dx, dy, x, w, rstd, {}, Tensor::zeros({4, 8}, DType::F64));
      },
      "rmsnorm_backward_input_add: addend");
}

TEST(LinearBackwardInputAccumulate, GivesTheBitsOfTheInputGradientThenAccumulate) {
  Stream& s = Stream::cpu();
  Rng rng(74);
  const Tensor dy = random_tensor({9, 6}, DType::F32, rng);
  const Tensor w = random_tensor({6, 11}, DType::F32, rng);
  const Tensor dx0 = random_tensor({9, 11}, DType::F32, rng);
  Tensor got = dx0.clone();
  linear_backward_input_accumulate(s, got, dy, w);
  Tensor want = dx0.clone();
  Tensor product = Tensor::empty({9, 11}, DType::F32);
  linear_backward_input(s, product, dy, w);
  accumulate(s, want, product);
  EXPECT_TRUE(same_bytes(got, want));
  expect_error(
      [&] {
        linear_backward_input_accumulate(s, Tensor::zeros({9, 10}, DType::F32), dy, w);
      },
      "linear_backward_input_accumulate: dx [M, K]");
  expect_error(
      [&] {
        linear_backward_input_accumulate(s, got, dy, Tensor::zeros({5, 11}, DType::F32));
      },
      "linear_backward_input_accumulate: dy [M, N] is [9, 6] but w [N, K] is [5, 11]");
}

}  // namespace
}  // namespace moetrain::ops
