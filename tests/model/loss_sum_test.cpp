// Tests for model::LossSum: a sum left pending on the device refuses to be read before resolve_losses reads it (it
// would otherwise read as zero), resolve_losses reads every pending sum in order and leaves the resolved ones alone,
// and a malformed pending tensor is refused by name.
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "model/causal_lm.h"
#include "ops/loss.h"
#include "testing/cuda_compare.h"

namespace moetrain::model {
namespace {

using testing::expect_error;

// The pending {sum, count} of `losses` over `targets` (the CPU's form of what head_forward leaves on a GPU).
LossSum pending_sum(const std::vector<float>& losses, const std::vector<int32_t>& targets) {
  const auto rows = static_cast<int64_t>(losses.size());
  return LossSum::pending_on_device(ops::cross_entropy_totals_pending(
      Stream::cpu(), Tensor::from_vector<float>(losses, {rows}), Tensor::from_vector<int32_t>(targets, {rows})));
}

TEST(LossSum, APendingSumRefusesToBeReadUntilResolved) {
  const LossSum pending = pending_sum({2.0f, 3.0f}, {1, 4});
  EXPECT_FALSE(pending.resolved());
  expect_error([&] { (void)pending.ce_sum(); }, {"LossSum", "still on cpu", "resolve_losses"});
  expect_error([&] { (void)pending.num_targets(); }, {"LossSum", "target count", "resolve_losses"});
}

TEST(LossSum, ResolveReadsEveryPendingSumInOrderAndKeepsTheResolvedOnes) {
  std::vector<LossSum> losses = {pending_sum({2.0f, 3.0f}, {1, 4}), LossSum(),
                                 pending_sum({0.5f, 7.0f, 1.0f}, {0, ops::kIgnoreIndex, 2})};
  resolve_losses(losses);
  for (const LossSum& l : losses) EXPECT_TRUE(l.resolved());
  EXPECT_EQ(losses[0].ce_sum(), 5.0);
  EXPECT_EQ(losses[0].num_targets(), 2);
  EXPECT_EQ(losses[1].ce_sum(), 0.0);  // the empty sum of a stage without the head
  EXPECT_EQ(losses[1].num_targets(), 0);
  EXPECT_EQ(losses[2].ce_sum(), 1.5);  // the ignored target's loss is not counted
  EXPECT_EQ(losses[2].num_targets(), 2);
  resolve_losses(losses);  // nothing pending: nothing changes
  EXPECT_EQ(losses[0].ce_sum(), 5.0);
}

TEST(LossSum, RefusesPendingTotalsThatAreNotTwoF64Values) {
  expect_error([] { (void)LossSum::pending_on_device(Tensor::zeros({2}, DType::F32)); }, {"LossSum", "f64 [2]", "f32"});
  expect_error([] { (void)LossSum::pending_on_device(Tensor::zeros({3}, DType::F64)); }, {"LossSum", "f64 [2]"});
  expect_error([] { (void)LossSum::pending_on_device(Tensor()); }, {"LossSum", "none"});
  std::vector<LossSum*> resolved_one = {nullptr};
  LossSum resolved;
  resolved_one[0] = &resolved;
  expect_error([&] { LossSum::read(Stream::cpu(), resolved_one); }, {"LossSum::read", "already read"});
}

}  // namespace
}  // namespace moetrain::model
