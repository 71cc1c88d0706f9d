// Tests for ops/grouped_gemm: forward against a per-group direct matmul (incl. empty groups), row invariance
// under group size, backward input and weight against finite differences, accumulation, and argument checks.
#include "ops/grouped_gemm.h"

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

Tensor offsets_tensor(const std::vector<int32_t>& offsets) {
  return Tensor::from_vector<int32_t>(offsets, {static_cast<int64_t>(offsets.size())});
}

Tensor forward(const Tensor& x, const Tensor& w, const Tensor& offsets) {
  Tensor y = Tensor::empty({x.size(0), w.size(1)}, x.dtype());
  ops::grouped_linear_forward(Stream::cpu(), y, x, w, offsets);
  return y;
}

// Group sizes 5, 0, 7, 0 (empty groups in the middle and at the end); N and K not multiples of a tile.
const std::vector<int32_t> kOffsets{0, 5, 5, 12, 12};
constexpr int64_t kGroups = 4, kRows = 12, kOut = 7, kIn = 9;

TEST(GroupedLinear, ForwardMatchesPerGroupMatmulWithEmptyGroups) {
  Rng rng(1);
  const Tensor x = random_tensor({kRows, kIn}, DType::F32, rng);
  const Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F32, rng);
  const Tensor y = forward(x, w, offsets_tensor(kOffsets));
  Tensor expected = Tensor::zeros({kRows, kOut}, DType::F64);
  for (int64_t g = 0; g < kGroups; ++g) {
    for (int64_t r = kOffsets[g]; r < kOffsets[g + 1]; ++r) {
      for (int64_t n = 0; n < kOut; ++n) {
        double s = 0.0;
        for (int64_t k = 0; k < kIn; ++k) {
          s += static_cast<double>(x.data<float>()[r * kIn + k]) * w.data<float>()[(g * kOut + n) * kIn + k];
        }
        expected.data<double>()[r * kOut + n] = s;
      }
    }
  }
  EXPECT_LT(relative_error(y, expected), 1e-6);
}

TEST(GroupedLinear, RowResultDoesNotDependOnTheOtherRows) {
  Rng rng(2);
  const Tensor x = random_tensor({kRows, kIn}, DType::F32, rng);
  const Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F32, rng);
  const Tensor y = forward(x, w, offsets_tensor(kOffsets));
  // Row 9 (group 2) alone in group 2, and rows 6..11 as a group 2 of their own (other tile boundaries).
  const Tensor alone = forward(x.slice(9, 10).clone(), w, offsets_tensor({0, 0, 0, 1, 1}));
  EXPECT_EQ(alone.to_vector<float>(), y.slice(9, 10).clone().to_vector<float>());
  const Tensor more = forward(x.slice(6, 12).clone(), w, offsets_tensor({0, 0, 0, 6, 6}));
  EXPECT_EQ(more.to_vector<float>(), y.slice(6, 12).clone().to_vector<float>());
}

TEST(GroupedLinear, BackwardInputMatchesFiniteDifferences) {
  Rng rng(3);
  Tensor x = random_tensor({kRows, kIn}, DType::F64, rng);
  const Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F64, rng);
  const Tensor r = random_tensor({kRows, kOut}, DType::F64, rng);
  const Tensor offsets = offsets_tensor(kOffsets);
  Tensor dx = Tensor::empty({kRows, kIn}, DType::F64);
  ops::grouped_linear_backward_input(Stream::cpu(), dx, r, w, offsets);
  testing::expect_gradients_match([&] { return testing::dot(forward(x, w, offsets), r); }, {{"x", x, dx}});
}

TEST(GroupedLinear, BackwardWeightMatchesFiniteDifferences) {
  Rng rng(4);
  const Tensor x = random_tensor({kRows, kIn}, DType::F64, rng);
  Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F64, rng);
  const Tensor r = random_tensor({kRows, kOut}, DType::F64, rng);
  const Tensor offsets = offsets_tensor(kOffsets);
  Tensor dw = Tensor::zeros({kGroups, kOut, kIn}, DType::F64);
  ops::grouped_linear_backward_weight(Stream::cpu(), dw, r, x, offsets);
  testing::expect_gradients_match([&] { return testing::dot(forward(x, w, offsets), r); }, {{"w", w, dw}});
}

TEST(GroupedLinear, BackwardWeightAccumulatesAndLeavesEmptyGroupsUntouched) {
  Rng rng(5);
  const Tensor x = random_tensor({kRows, kIn}, DType::F64, rng);
  const Tensor dy = random_tensor({kRows, kOut}, DType::F64, rng);
  const Tensor offsets = offsets_tensor(kOffsets);
  Tensor fresh = Tensor::zeros({kGroups, kOut, kIn}, DType::F64);
  ops::grouped_linear_backward_weight(Stream::cpu(), fresh, dy, x, offsets);
  const Tensor start = random_tensor({kGroups, kOut, kIn}, DType::F64, rng);
  Tensor dw = start.clone();
  ops::grouped_linear_backward_weight(Stream::cpu(), dw, dy, x, offsets);
  for (int64_t i = 0; i < dw.numel(); ++i) {
    EXPECT_EQ(dw.data<double>()[i], start.data<double>()[i] + fresh.data<double>()[i]) << "element " << i;
  }
  for (int64_t g : {1, 3}) {
    EXPECT_EQ(dw.select(g).to_vector<double>(), start.select(g).to_vector<double>()) << "empty group " << g;
  }
}

// The overwriting form (a step's first write) replaces whatever dw held with the bytes accumulating onto zeros gives,
// and makes the empty groups 0.
TEST(GroupedLinear, BackwardWeightOverwriteGivesTheBytesOfAddingOntoZeros) {
  Rng rng(7);
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random_tensor({kRows, kIn}, dtype, rng);
    const Tensor dy = random_tensor({kRows, kOut}, dtype, rng);
    const Tensor offsets = offsets_tensor(kOffsets);
    Tensor onto_zeros = Tensor::zeros({kGroups, kOut, kIn}, dtype);
    ops::grouped_linear_backward_weight(Stream::cpu(), onto_zeros, dy, x, offsets);
    Tensor dw = random_tensor({kGroups, kOut, kIn}, dtype, rng);
    ops::grouped_linear_backward_weight(Stream::cpu(), dw, dy, x, offsets, ops::GradientWrite::Overwrite);
    ASSERT_EQ(dw.nbytes(), onto_zeros.nbytes());
    EXPECT_EQ(std::memcmp(dw.raw_data(), onto_zeros.raw_data(), dw.nbytes()), 0);
    for (int64_t g : {1, 3}) {
      for (double v : dw.select(g).to(DType::F64).to_vector<double>()) EXPECT_EQ(v, 0.0) << "empty group " << g;
    }
  }
}

TEST(GroupedLinear, RejectsBadOffsetsAndShapes) {
  Stream& s = Stream::cpu();
  Rng rng(6);
  const Tensor x = random_tensor({kRows, kIn}, DType::F32, rng);
  const Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F32, rng);
  Tensor y = Tensor::empty({kRows, kOut}, DType::F32);
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, offsets_tensor({0, 5, 5, 10, 10}));
      },
      "grouped_linear_forward: the last offset offsets[4] must equal the row count R = 12 but found 10");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, offsets_tensor({1, 5, 5, 12, 12}));
      },
      "grouped_linear_forward: offsets[0] must be 0 but found 1");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, offsets_tensor({0, 6, 5, 12, 12}));
      },
      "offsets must not decrease but offsets[2] = 5 follows offsets[1] = 6");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, offsets_tensor({0, 5, 12, 12}));
      },
      "grouped_linear_forward: offsets: expected shape [5] but found [4]");
  expect_error([&] { ops::grouped_linear_forward(s, y, x, w, Tensor::zeros({5}, DType::I64)); },
               "grouped_linear_forward: offsets: expected dtype i32 but found i64");
  expect_error([&] { ops::grouped_linear_forward(s, y, x.slice(0, 11), w, offsets_tensor(kOffsets)); },
               "grouped_linear_forward: y: expected shape [11, 7] but found [12, 7]");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, random_tensor({kRows, 8}, DType::F32, rng), w, offsets_tensor(kOffsets));
      },
      "grouped_linear_forward: x: expected shape [12, 9] but found [12, 8]");
  expect_error([&] { ops::grouped_linear_forward(s, y, x.to(DType::F64), w, offsets_tensor(kOffsets)); },
               "grouped_linear_forward: x: expected dtype f32 but found f64");
  Tensor dx = Tensor::empty({kRows, kIn}, DType::F32);
  expect_error(
      [&] {
        ops::grouped_linear_backward_input(s, dx, y, w, offsets_tensor({0, 5, 5, 12, 13}));
      },
      "grouped_linear_backward_input: the last offset offsets[4] must equal the row count R = 12");
  expect_error(
      [&] {
        ops::grouped_linear_backward_input(s, Tensor::empty({kRows, 8}, DType::F32), y, w, offsets_tensor(kOffsets));
      },
      "grouped_linear_backward_input: dx: expected shape [12, 9] but found [12, 8]");
  Tensor dw = Tensor::zeros({kGroups, kOut, kIn}, DType::F32);
  expect_error([&] { ops::grouped_linear_backward_weight(s, dw, y.slice(0, 11), x, offsets_tensor(kOffsets)); },
               "grouped_linear_backward_weight: dy: expected shape [12, 7] but found [11, 7]");
  expect_error(
      [&] {
        ops::grouped_linear_backward_weight(s, Tensor::zeros({kOut, kIn}, DType::F32), y, x, offsets_tensor(kOffsets));
      },
      "grouped_linear_backward_weight: expected dw [G, N, K] but found f32[7, 9] on cpu");
}

// The gathered forward is permute_forward followed by the forward (on the CPU it runs them), and refuses operands and
// a plan that do not match: tokens, experts, y's shape, x's dtype, the row choices' length, the offsets.
TEST(GroupedLinear, ForwardGatheredIsPermuteThenForwardAndChecksThePlan) {
  Stream& s = Stream::cpu();
  Rng rng(8);
  constexpr int64_t kTokens = 6, kTopK = 2;
  // Six tokens' two experts each, among the 4 groups.
  const Tensor topk_index = Tensor::from_vector<int32_t>({0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 3}, {kTokens, kTopK});
  const ops::RoutingPlan plan = ops::make_routing_plan(s, topk_index, kGroups);
  const Tensor x = random_tensor({kTokens, kIn}, DType::F32, rng);
  const Tensor w = random_tensor({kGroups, kOut, kIn}, DType::F32, rng);
  Tensor permuted = Tensor::empty({kTokens * kTopK, kIn}, DType::F32);
  ops::permute_forward(s, permuted, x, plan);
  Tensor want = Tensor::empty({kTokens * kTopK, kOut}, DType::F32);
  ops::grouped_linear_forward(s, want, permuted, w, plan.expert_offsets);
  Tensor got = Tensor::empty({kTokens * kTopK, kOut}, DType::F32);
  ops::grouped_linear_forward_gathered(s, got, x, plan, w);
  EXPECT_EQ(std::memcmp(got.raw_data(), want.raw_data(), got.nbytes()), 0);

  expect_error([&] { ops::grouped_linear_forward_gathered(s, got, x.slice(0, 5), plan, w); },
               "grouped_linear_forward_gathered: expected w's 4 groups and x's 5 tokens to match the plan's 4 "
               "experts and 6 tokens");
  expect_error(
      [&] {
        ops::grouped_linear_forward_gathered(s, got, x, plan, random_tensor({3, kOut, kIn}, DType::F32, rng));
      },
      "grouped_linear_forward_gathered: expected w's 3 groups and x's 6 tokens to match the plan's 4 experts");
  expect_error([&] { ops::grouped_linear_forward_gathered(s, got.slice(0, 11), x, plan, w); },
               "grouped_linear_forward_gathered: y: expected shape [12, 7] but found [11, 7]");
  expect_error([&] { ops::grouped_linear_forward_gathered(s, got, x.to(DType::F64), plan, w); },
               "grouped_linear_forward_gathered: x: expected dtype f32 but found f64");
  ops::RoutingPlan short_choices = plan;
  short_choices.row_choice = plan.row_choice.slice(0, 11);
  expect_error([&] { ops::grouped_linear_forward_gathered(s, got, x, short_choices, w); },
               "grouped_linear_forward_gathered: plan.row_choice: expected shape [12] but found [11]");
  ops::RoutingPlan bad_offsets = plan;
  bad_offsets.expert_offsets = Tensor::from_vector<int32_t>({0, 3, 6, 9, 11}, {5});
  expect_error([&] { ops::grouped_linear_forward_gathered(s, got, x, bad_offsets, w); },
               "grouped_linear_forward_gathered: the last offset offsets[4] must equal the row count R = 12 but "
               "found 11");
}

}  // namespace
}  // namespace moetrain
