// Tests for the column-block moves (ops/columns.h) on the CPU: the copy against an element-by-element reference,
// with and without repeated rows and for any dtype; the repeated sum as the copy's adjoint (<copy(x), y> =
// <x, sum(y)> in f64) and its ascending order; and every refused argument.
#include "ops/columns.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

Stream& cpu() { return Stream::cpu(); }

TEST(Columns, CopyMovesTheBlockAndLeavesTheRest) {
  Rng rng(3);
  for (const int64_t repeat : {1, 4}) {
    const Tensor src = testing::random_tensor({5, 7}, DType::F32, rng);
    Tensor dst = testing::random_tensor({5 * repeat, 3, 6}, DType::F32, rng);  // rows = 5 * repeat * 3 / 3 ...
    dst = dst.view({5 * repeat, 18});
    const std::vector<float> before = dst.to_vector<float>();
    copy_columns(cpu(), dst, 10, src, 2, 5, repeat);
    const std::vector<float> got = dst.to_vector<float>(), s = src.to_vector<float>();
    for (int64_t r = 0; r < 5 * repeat; ++r) {
      for (int64_t c = 0; c < 18; ++c) {
        const size_t at = static_cast<size_t>(r * 18 + c);
        const float want = c >= 10 && c < 15 ? s[static_cast<size_t>((r / repeat) * 7 + 2 + (c - 10))] : before[at];
        ASSERT_EQ(got[at], want) << "repeat " << repeat << " row " << r << " column " << c;
      }
    }
  }
}

TEST(Columns, CopyTreatsTheLastDimensionAsColumnsForAnyDtype) {
  const Tensor src = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 1, 3});
  Tensor dst = Tensor::zeros({2, 2, 3}, DType::I32);
  copy_columns(cpu(), dst, 0, src, 1, 2, 2);  // every source row to two destination rows
  EXPECT_EQ(dst.to_vector<int32_t>(), (std::vector<int32_t>{2, 3, 0, 2, 3, 0, 5, 6, 0, 5, 6, 0}));
}

TEST(Columns, RepeatedSumIsTheAdjointOfTheRepeatedCopy) {
  Rng rng(5);
  const int64_t rows = 6, repeat = 3, width = 4;
  const Tensor x = testing::random_tensor({rows, 9}, DType::F64, rng);
  const Tensor y = testing::random_tensor({rows * repeat, 8}, DType::F64, rng);
  Tensor copied = Tensor::zeros({rows * repeat, 8}, DType::F64);
  copy_columns(cpu(), copied, 3, x, 5, width, repeat);
  Tensor summed = Tensor::zeros({rows, 9}, DType::F64);
  sum_repeated_columns(cpu(), summed, 5, y, 3, width, repeat);
  double lhs = 0.0, rhs = 0.0;
  const std::vector<double> c = copied.to_vector<double>(), yv = y.to_vector<double>();
  const std::vector<double> sv = summed.to_vector<double>(), xv = x.to_vector<double>();
  for (size_t i = 0; i < c.size(); ++i) lhs += c[i] * yv[i];
  for (size_t i = 0; i < sv.size(); ++i) rhs += xv[i] * sv[i];
  EXPECT_NEAR(lhs, rhs, 1e-12 * std::abs(lhs));
  // Ascending order in the dtype: row r column 5 + j = y[3r + 0] + y[3r + 1] + y[3r + 2] at column 3 + j.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const double want = (yv[size_t((r * repeat) * 8 + 3 + j)] + yv[size_t((r * repeat + 1) * 8 + 3 + j)]) +
                          yv[size_t((r * repeat + 2) * 8 + 3 + j)];
      ASSERT_EQ(sv[size_t(r * 9 + 5 + j)], want) << r << " " << j;
    }
  }
}

TEST(Columns, Bf16SumsInF32AndRoundsOnce) {
  const Tensor y = Tensor::from_vector<float>({1.0f, 1.0f / 512, 1.0f / 512}, {3, 1}).to(DType::BF16);
  Tensor out = Tensor::zeros({1, 1}, DType::BF16);
  sum_repeated_columns(cpu(), out, 0, y, 0, 1, 3);
  // 1 + 2^-9 + 2^-9 = 1 + 2^-8: exact in f32, then rounded once to bf16 (to 1 + 2^-7 or 1 by nearest even).
  const float want = Tensor::from_vector<float>({1.0f + 1.0f / 256}, {1}).to(DType::BF16).to(DType::F32).item<float>();
  EXPECT_EQ(out.to(DType::F32).item<float>(), want);
}

TEST(Columns, RefusesBadArguments) {
  const Tensor a = Tensor::zeros({4, 6}, DType::F32);
  Tensor b = Tensor::zeros({4, 6}, DType::F32);
  EXPECT_THROW(copy_columns(cpu(), b, 3, a, 0, 4), Error);     // past dst's columns
  EXPECT_THROW(copy_columns(cpu(), b, 0, a, 4, 3), Error);     // past src's columns
  EXPECT_THROW(copy_columns(cpu(), b, 0, a, 0, 2, 2), Error);  // rows(dst) != rows(src) x 2
  EXPECT_THROW(copy_columns(cpu(), b, -1, a, 0, 2), Error);    // negative column
  Tensor i32 = Tensor::zeros({4, 6}, DType::I32);
  EXPECT_THROW(copy_columns(cpu(), i32, 0, a, 0, 2), Error);  // dtypes differ
  EXPECT_THROW(sum_repeated_columns(cpu(), i32, 0, Tensor::zeros({8, 6}, DType::I32), 0, 2, 2), Error);  // not float
  EXPECT_THROW(sum_repeated_columns(cpu(), b, 0, a, 0, 2, 2), Error);  // rows(src) != rows(dst) x 2
  EXPECT_NO_THROW(copy_columns(cpu(), b, 2, a, 0, 0));                 // an empty block
}

}  // namespace
}  // namespace moetrain::ops
