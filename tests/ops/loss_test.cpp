// Tests for ops/loss: cross-entropy forward against a direct log-softmax, ignored rows, backward against finite
// differences, the fused forward + backward against the two ops, the f64 totals, batch invariance, and argument
// checks.
#include "ops/loss.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;
using testing::relative_error;

double value(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

Tensor targets_tensor(const std::vector<int32_t>& targets) {
  return Tensor::from_vector<int32_t>(targets, {static_cast<int64_t>(targets.size())});
}

struct Outputs {
  Tensor losses, lse;
};

Outputs forward(const Tensor& logits, const Tensor& targets) {
  Outputs out{Tensor::zeros({logits.size(0)}, logits.dtype()), Tensor::zeros({logits.size(0)}, logits.dtype())};
  ops::cross_entropy_forward(Stream::cpu(), out.losses, out.lse, logits, targets);
  return out;
}

TEST(CrossEntropy, ForwardMatchesDirectComputation) {
  const std::vector<int32_t> targets = {3, 0, ops::kIgnoreIndex, 10, 7};
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(11);
    const Tensor logits = random_tensor({5, 11}, dtype, rng, 3.0);
    const Outputs out = forward(logits, targets_tensor(targets));
    EXPECT_EQ(out.losses.dtype(), dtype);
    // Direct: lse = log(sum exp(x)) in f64 without the max shift (the values are small), loss = lse - x[target].
    Tensor ref_lse = Tensor::zeros({5}, DType::F64);
    Tensor ref_losses = Tensor::zeros({5}, DType::F64);
    for (int64_t t = 0; t < 5; ++t) {
      double sum = 0.0;
      for (int64_t v = 0; v < 11; ++v) sum += std::exp(value(logits, t * 11 + v));
      ref_lse.data<double>()[t] = std::log(sum);
      if (targets[t] != ops::kIgnoreIndex) {
        ref_losses.data<double>()[t] = std::log(sum) - value(logits, t * 11 + targets[t]);
      }
    }
    const double tolerance = dtype == DType::F64 ? 1e-14 : 1e-6;
    EXPECT_LT(relative_error(out.lse.to(DType::F64), ref_lse), tolerance);
    EXPECT_LT(relative_error(out.losses.to(DType::F64), ref_losses), tolerance);
  }
}

TEST(CrossEntropy, ForwardIsStableForLargeLogits) {
  // exp(1000) overflows even f64; the max-subtracted form does not.
  const Tensor logits = Tensor::from_vector<float>({1000.0f, 1001.0f, 999.0f}, {1, 3});
  const Outputs out = forward(logits, targets_tensor({1}));
  const double lse = 1001.0 + std::log(std::exp(-1.0) + 1.0 + std::exp(-2.0));
  EXPECT_NEAR(out.lse.data<float>()[0], lse, 1e-3);
  EXPECT_NEAR(out.losses.data<float>()[0], lse - 1001.0, 1e-4);
}

TEST(CrossEntropy, IgnoredRowsGiveZeroLossAndZeroGradient) {
  Rng rng(3);
  const Tensor logits = random_tensor({3, 6}, DType::F32, rng);
  const Tensor targets = targets_tensor({ops::kIgnoreIndex, 2, ops::kIgnoreIndex});
  const Outputs out = forward(logits, targets);
  EXPECT_EQ(out.losses.data<float>()[0], 0.0f);
  EXPECT_EQ(out.losses.data<float>()[2], 0.0f);
  EXPECT_GT(out.losses.data<float>()[1], 0.0f);
  Tensor dlogits = Tensor::empty({3, 6}, DType::F32);
  ops::cross_entropy_backward(Stream::cpu(), dlogits, logits, out.lse, targets, 0.5);
  for (int64_t v = 0; v < 6; ++v) {
    EXPECT_EQ(dlogits.data<float>()[v], 0.0f);
    EXPECT_EQ(dlogits.data<float>()[12 + v], 0.0f);
    EXPECT_NE(dlogits.data<float>()[6 + v], 0.0f);
  }
}

TEST(CrossEntropy, CustomIgnoreIndexIsHonoured) {
  Rng rng(4);
  const Tensor logits = random_tensor({2, 4}, DType::F64, rng);
  Outputs out{Tensor::zeros({2}, DType::F64), Tensor::zeros({2}, DType::F64)};
  ops::cross_entropy_forward(Stream::cpu(), out.losses, out.lse, logits, targets_tensor({-1, 1}), -1);
  EXPECT_EQ(out.losses.data<double>()[0], 0.0);
  const ops::LossTotals totals = ops::cross_entropy_totals(Stream::cpu(), out.losses, targets_tensor({-1, 1}), -1);
  EXPECT_EQ(totals.count, 1);
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  Rng rng(5);
  const Tensor logits = random_tensor({6, 9}, DType::F64, rng, 2.0);
  const Tensor targets = targets_tensor({0, 8, ops::kIgnoreIndex, 4, 4, 1});
  const double scale = 1.0 / 5.0;
  const Outputs out = forward(logits, targets);
  Tensor dlogits = Tensor::empty({6, 9}, DType::F64);
  ops::cross_entropy_backward(Stream::cpu(), dlogits, logits, out.lse, targets, scale);
  const auto loss = [&] {
    const Outputs o = forward(logits, targets);
    double sum = 0.0;
    for (int64_t t = 0; t < 6; ++t) sum += o.losses.data<double>()[t];
    return sum * scale;
  };
  testing::expect_gradients_match(loss, {{"logits", logits, dlogits}});
}

TEST(CrossEntropy, BackwardMayOverwriteLogits) {
  Rng rng(6);
  const Tensor logits = random_tensor({4, 7}, DType::F32, rng);
  const Tensor targets = targets_tensor({1, 2, 3, ops::kIgnoreIndex});
  const Outputs out = forward(logits, targets);
  Tensor separate = Tensor::empty({4, 7}, DType::F32);
  ops::cross_entropy_backward(Stream::cpu(), separate, logits, out.lse, targets, 0.25);
  Tensor in_place = logits.clone();
  ops::cross_entropy_backward(Stream::cpu(), in_place, in_place, out.lse, targets, 0.25);
  EXPECT_EQ(std::memcmp(separate.raw_data(), in_place.raw_data(), separate.nbytes()), 0);
}

// The fused call is the two ops in turn: the same losses, lse and gradient bits, into a separate gradient or in place.
TEST(CrossEntropy, ForwardBackwardGivesTheBitsOfTheTwoOps) {
  Rng rng(16);
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor logits = random_tensor({6, 11}, dtype, rng, 2.0);
    const Tensor targets = targets_tensor({1, ops::kIgnoreIndex, 10, 0, 3, ops::kIgnoreIndex});
    const Outputs want = forward(logits, targets);
    Tensor want_grad = Tensor::empty({6, 11}, dtype);
    ops::cross_entropy_backward(Stream::cpu(), want_grad, logits, want.lse, targets, 0.125);
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(in_place ? "in place" : "separate gradient");
      Outputs got{Tensor::zeros({6}, dtype), Tensor::zeros({6}, dtype)};
      Tensor input = logits.clone();
      Tensor grad = in_place ? input : Tensor::empty({6, 11}, dtype);
      ops::cross_entropy_forward_backward(Stream::cpu(), got.losses, got.lse, grad, input, targets, 0.125);
      EXPECT_EQ(std::memcmp(got.losses.raw_data(), want.losses.raw_data(), want.losses.nbytes()), 0);
      EXPECT_EQ(std::memcmp(got.lse.raw_data(), want.lse.raw_data(), want.lse.nbytes()), 0);
      EXPECT_EQ(std::memcmp(grad.raw_data(), want_grad.raw_data(), want_grad.nbytes()), 0);
    }
  }
}

TEST(CrossEntropy, RowResultsDoNotDependOnOtherRows) {
  Rng rng(7);
  const Tensor big = random_tensor({9, 33}, DType::F32, rng, 2.0);
  const std::vector<int32_t> all_targets = {5, 1, 32, 0, ops::kIgnoreIndex, 7, 7, 20, 3};
  const Outputs full = forward(big, targets_tensor(all_targets));
  Tensor dfull = Tensor::empty({9, 33}, DType::F32);
  ops::cross_entropy_backward(Stream::cpu(), dfull, big, full.lse, targets_tensor(all_targets), 0.1);
  // Rows 3..5 alone.
  const Tensor part = big.slice(3, 6).clone();
  const std::vector<int32_t> part_targets(all_targets.begin() + 3, all_targets.begin() + 6);
  const Outputs alone = forward(part, targets_tensor(part_targets));
  Tensor dalone = Tensor::empty({3, 33}, DType::F32);
  ops::cross_entropy_backward(Stream::cpu(), dalone, part, alone.lse, targets_tensor(part_targets), 0.1);
  EXPECT_EQ(std::memcmp(alone.losses.raw_data(), full.losses.slice(3, 6).raw_data(), 3 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(alone.lse.raw_data(), full.lse.slice(3, 6).raw_data(), 3 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(dalone.raw_data(), dfull.slice(3, 6).raw_data(), dalone.nbytes()), 0);
}

TEST(CrossEntropy, TotalsSumInAscendingOrderAndCountTargets) {
  const Tensor losses = Tensor::from_vector<float>({1e8f, 1.0f, 7.0f, -1e8f, 0.5f}, {5});
  const Tensor targets = targets_tensor({1, 2, ops::kIgnoreIndex, 3, 4});
  const ops::LossTotals totals = ops::cross_entropy_totals(Stream::cpu(), losses, targets);
  // Ascending in f64: ((1e8 + 1) + -1e8) + 0.5, skipping the ignored row.
  EXPECT_EQ(totals.sum, ((1e8 + 1.0) + -1e8) + 0.5);
  EXPECT_EQ(totals.count, 4);
  const ops::LossTotals none =
      ops::cross_entropy_totals(Stream::cpu(), Tensor::zeros({0}, DType::F64), Tensor::zeros({0}, DType::I32));
  EXPECT_EQ(none.sum, 0.0);
  EXPECT_EQ(none.count, 0);
}

TEST(CrossEntropy, PendingTotalsOnTheCpuAreTheTotalsAndReadInOrder) {
  const Tensor losses = Tensor::from_vector<float>({1e8f, 1.0f, 7.0f, -1e8f, 0.5f}, {5});
  const Tensor targets = targets_tensor({1, 2, ops::kIgnoreIndex, 3, 4});
  const Tensor first = ops::cross_entropy_totals_pending(Stream::cpu(), losses, targets);
  const Tensor second = ops::cross_entropy_totals_pending(Stream::cpu(), losses.slice(0, 2), targets.slice(0, 2));
  const std::vector<ops::LossTotals> read = ops::read_loss_totals(Stream::cpu(), {first, second});
  ASSERT_EQ(read.size(), 2u);
  EXPECT_EQ(read[0].sum, ((1e8 + 1.0) + -1e8) + 0.5);
  EXPECT_EQ(read[0].count, 4);
  EXPECT_EQ(read[1].sum, 1e8 + 1.0);
  EXPECT_EQ(read[1].count, 2);
  EXPECT_TRUE(ops::read_loss_totals(Stream::cpu(), {}).empty());
  expect_error(
      [&] {
        ops::read_loss_totals(Stream::cpu(), {first, Tensor::zeros({2}, DType::F32)});
      },
      {"read_loss_totals", "f64 [2]", "entry 1"});
}

TEST(CrossEntropy, RejectsTargetOutsideVocabulary) {
  const Tensor logits = Tensor::zeros({3, 5}, DType::F32);
  Tensor losses = Tensor::zeros({3}, DType::F32), lse = Tensor::zeros({3}, DType::F32);
  expect_error(
      [&] {
        ops::cross_entropy_forward(Stream::cpu(), losses, lse, logits, targets_tensor({0, 5, 1}));
      },
      {"targets[1] = 5", "[0, V = 5)"});
  expect_error(
      [&] {
        ops::cross_entropy_forward(Stream::cpu(), losses, lse, logits, targets_tensor({-2, 0, 1}));
      },
      {"targets[0] = -2"});
  Tensor dlogits = Tensor::zeros({3, 5}, DType::F32);
  expect_error(
      [&] {
        ops::cross_entropy_backward(Stream::cpu(), dlogits, logits, lse, targets_tensor({0, 1, 9}), 1.0);
      },
      {"targets[2] = 9"});
}

TEST(CrossEntropy, RejectsMismatchedShapesAndDtypes) {
  const Tensor logits = Tensor::zeros({3, 5}, DType::F32);
  const Tensor targets = targets_tensor({0, 1, 2});
  Tensor lse = Tensor::zeros({3}, DType::F32);
  Tensor short_losses = Tensor::zeros({2}, DType::F32);
  expect_error([&] { ops::cross_entropy_forward(Stream::cpu(), short_losses, lse, logits, targets); },
               {"losses", "expected shape [3]", "found [2]"});
  Tensor f64_losses = Tensor::zeros({3}, DType::F64);
  expect_error([&] { ops::cross_entropy_forward(Stream::cpu(), f64_losses, lse, logits, targets); },
               {"losses", "expected dtype f32", "found f64"});
  Tensor losses = Tensor::zeros({3}, DType::F32);
  const Tensor i64_targets = Tensor::zeros({3}, DType::I64);
  expect_error([&] { ops::cross_entropy_forward(Stream::cpu(), losses, lse, logits, i64_targets); },
               {"targets", "expected dtype i32", "found i64"});
  expect_error(
      [&] {
        ops::cross_entropy_forward(Stream::cpu(), losses, lse, Tensor::zeros({3, 5}, DType::I32), targets);
      },
      {"logits", "f32 or f64", "i32"});
  expect_error(
      [&] { ops::cross_entropy_forward(Stream::cpu(), losses, lse, Tensor::zeros({15}, DType::F32), targets); },
      {"logits [T, V]", "f32[15]"});
  Tensor bad_dlogits = Tensor::zeros({3, 4}, DType::F32);
  expect_error([&] { ops::cross_entropy_backward(Stream::cpu(), bad_dlogits, logits, lse, targets, 1.0); },
               {"dlogits", "expected shape [3, 5]", "found [3, 4]"});
  expect_error(
      [&] { ops::cross_entropy_forward_backward(Stream::cpu(), losses, lse, bad_dlogits, logits, targets, 1.0); },
      {"cross_entropy_forward_backward", "dlogits", "expected shape [3, 5]", "found [3, 4]"});
  expect_error(
      [&] { ops::cross_entropy_forward_backward(Stream::cpu(), short_losses, lse, bad_dlogits, logits, targets, 1.0); },
      {"cross_entropy_forward_backward", "losses", "expected shape [3]", "found [2]"});
  Tensor dlogits = Tensor::zeros({3, 5}, DType::F32);
  expect_error(
      [&] { ops::cross_entropy_forward_backward(Stream::cpu(), losses, lse, dlogits, logits, targets, std::nan("")); },
      {"cross_entropy_forward_backward", "finite scale"});
  expect_error(
      [&] {
        ops::cross_entropy_totals(Stream::cpu(), losses, targets_tensor({0, 1}));
      },
      {"targets", "expected shape [3]", "found [2]"});
}

}  // namespace
}  // namespace moetrain
