// Tests for ops/bias: the bias added to every row and per group of rows (f32 and f64, an f32 bias on f64 rows), the
// gradients as exact ascending column sums, groups empty first, in the middle and last, no rows at all, the adjoint
// relation of add and backward by f64 finite differences, and every argument refusal.
#include "ops/bias.h"

#include <cmath>
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

Tensor offsets_of(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// y + bias[group of the row], in y's type T with the bias widened first: what the op must produce bit for bit.
template <typename T>
std::vector<T> expected_add(const Tensor& y, const Tensor& bias, const std::vector<int32_t>& offsets) {
  const int64_t width = y.size(1);
  std::vector<T> out = y.to_vector<T>();
  const std::vector<double> b = bias.to(DType::F64).to_vector<double>();  // exact for f32 and f64
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      for (int64_t n = 0; n < width; ++n) {
        out[static_cast<size_t>(r * width + n)] += static_cast<T>(b[g * static_cast<size_t>(width) + size_t(n)]);
      }
    }
  }
  return out;
}

// dbias0 + (the ascending sum in T of each group's rows), an empty group leaving its row as it was.
template <typename T>
std::vector<T> expected_sums(const Tensor& dbias0, const Tensor& dy, const std::vector<int32_t>& offsets) {
  const int64_t width = dy.size(1);
  std::vector<T> out = dbias0.to_vector<T>();
  const std::vector<T> d = dy.to_vector<T>();
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    if (offsets[g] == offsets[g + 1]) continue;
    for (int64_t n = 0; n < width; ++n) {
      T acc = T(0);
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) acc += d[static_cast<size_t>(r * width + n)];
      out[g * static_cast<size_t>(width) + size_t(n)] += acc;
    }
  }
  return out;
}

template <typename T>
void expect_add_exact(DType dtype, DType bias_dtype) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " rows, " + std::string(dtype_name(bias_dtype)) + " bias");
  Rng rng(40);
  const int64_t rows = 11, width = 70;  // more than one block of columns
  const Tensor y0 = random_tensor({rows, width}, dtype, rng);
  const Tensor bias = random_tensor({width}, bias_dtype, rng);
  Tensor y = y0.clone();
  bias_add(Stream::cpu(), y, bias);
  EXPECT_EQ(y.to_vector<T>(), expected_add<T>(y0, bias.view({1, width}), {0, static_cast<int32_t>(rows)}));

  // Groups: empty first, in the middle and last.
  const std::vector<int32_t> offsets{0, 0, 4, 4, 9, 11, 11};
  const Tensor grouped_bias = random_tensor({6, width}, bias_dtype, rng);
  Tensor yg = y0.clone();
  grouped_bias_add(Stream::cpu(), yg, grouped_bias, offsets_of(offsets));
  EXPECT_EQ(yg.to_vector<T>(), expected_add<T>(y0, grouped_bias, offsets));
}

TEST(Bias, AddIsTheBiasWidenedAndAddedToEveryRow) {
  expect_add_exact<float>(DType::F32, DType::F32);
  expect_add_exact<double>(DType::F64, DType::F64);
  expect_add_exact<double>(DType::F64, DType::F32);
}

template <typename T>
void expect_sums_exact(DType dtype) {
  SCOPED_TRACE(dtype_name(dtype));
  Rng rng(41);
  const int64_t rows = 37, width = 130;
  const Tensor dy = random_tensor({rows, width}, dtype, rng);
  const Tensor dbias0 = random_tensor({width}, dtype, rng);
  Tensor dbias = dbias0.clone();
  bias_backward(Stream::cpu(), dbias, dy);
  EXPECT_EQ(dbias.to_vector<T>(), expected_sums<T>(dbias0.view({1, width}), dy, {0, static_cast<int32_t>(rows)}));

  const std::vector<int32_t> offsets{0, 0, 10, 10, 10, 30, 37, 37};
  const Tensor grouped0 = random_tensor({7, width}, dtype, rng);
  Tensor grouped = grouped0.clone();
  grouped_bias_backward(Stream::cpu(), grouped, dy, offsets_of(offsets));
  EXPECT_EQ(grouped.to_vector<T>(), expected_sums<T>(grouped0, dy, offsets));
}

TEST(Bias, BackwardAddsTheAscendingColumnSums) {
  expect_sums_exact<float>(DType::F32);
  expect_sums_exact<double>(DType::F64);
}

// An empty group, or no rows at all, adds nothing: even a -0 entry keeps its sign (adding +0 would not).
TEST(Bias, EmptyGroupsAndNoRowsLeaveTheGradientBitwiseUnchanged) {
  const Tensor dbias0 = Tensor::from_vector<float>({-0.0f, 1.5f, -2.0f}, {3});
  Tensor dbias = dbias0.clone();
  bias_backward(Stream::cpu(), dbias, Tensor::zeros({0, 3}, DType::F32));
  EXPECT_TRUE(std::signbit(dbias.to_vector<float>()[0]));
  EXPECT_EQ(dbias.to_vector<float>(), dbias0.to_vector<float>());

  Tensor grouped = Tensor::from_vector<float>({-0.0f, 1.0f, -0.0f, 2.0f, -0.0f, 3.0f}, {3, 2});
  const Tensor dy = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  grouped_bias_backward(Stream::cpu(), grouped, dy, offsets_of({0, 0, 2, 2}));
  const std::vector<float> got = grouped.to_vector<float>();
  EXPECT_TRUE(std::signbit(got[0]));
  EXPECT_TRUE(std::signbit(got[4]));
  EXPECT_EQ(got, (std::vector<float>{-0.0f, 1.0f, 4.0f, 8.0f, -0.0f, 3.0f}));

  Tensor none = Tensor::from_vector<float>({-0.0f, 1.0f, -0.0f, 2.0f}, {2, 2});
  grouped_bias_backward(Stream::cpu(), none, Tensor::zeros({0, 2}, DType::F32), offsets_of({0, 0, 0}));
  EXPECT_TRUE(std::signbit(none.to_vector<float>()[0]));
  EXPECT_EQ(none.to_vector<float>(), (std::vector<float>{-0.0f, 1.0f, -0.0f, 2.0f}));

  // The adds on no rows are no-ops too.
  Tensor y = Tensor::zeros({0, 3}, DType::F32);
  bias_add(Stream::cpu(), y, dbias0);
  grouped_bias_add(Stream::cpu(), y, Tensor::zeros({2, 3}, DType::F32), offsets_of({0, 0, 0}));
}

// loss = dot(y0 + bias[group], g): its gradient by the bias is what the backward computes from g.
TEST(Bias, BackwardMatchesFiniteDifferencesOfTheAdd) {
  Rng rng(42);
  const int64_t rows = 9, width = 5;
  const Tensor y0 = random_tensor({rows, width}, DType::F64, rng);
  const Tensor g = random_tensor({rows, width}, DType::F64, rng);

  Tensor bias = random_tensor({width}, DType::F64, rng);
  Tensor dbias = Tensor::zeros({width}, DType::F64);
  bias_backward(Stream::cpu(), dbias, g);
  testing::expect_gradients_match(
      [&] {
        Tensor y = y0.clone();
        bias_add(Stream::cpu(), y, bias);
        return testing::dot(y, g);
      },
      {{"bias", bias, dbias}});

  const Tensor offsets = offsets_of({0, 3, 3, 9});
  Tensor grouped = random_tensor({3, width}, DType::F64, rng);
  Tensor dgrouped = Tensor::zeros({3, width}, DType::F64);
  grouped_bias_backward(Stream::cpu(), dgrouped, g, offsets);
  testing::expect_gradients_match(
      [&] {
        Tensor y = y0.clone();
        grouped_bias_add(Stream::cpu(), y, grouped, offsets);
        return testing::dot(y, g);
      },
      {{"bias", grouped, dgrouped}});
}

TEST(Bias, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  Tensor y = Tensor::zeros({4, 3}, DType::F32);
  const Tensor bias = Tensor::zeros({3}, DType::F32);
  expect_error([&] { bias_add(s, Tensor::zeros({12}, DType::F32), bias); },
               "bias_add: expected y [R, N] but found f32[12]");
  expect_error(
      [&] {
        bias_add(s, Tensor::zeros({4, 3}, DType::I32), bias);
      },
      "bias_add: expected y in f32 or f64 but found i32[4, 3]");
  expect_error([&] { bias_add(s, y, Tensor::zeros({4}, DType::F32)); },
               "bias_add: bias [N]: expected shape [3] but found [4]");
  expect_error([&] { bias_add(s, y, Tensor::zeros({3}, DType::F64)); },
               "bias_add: bias [N]: expected dtype f32 but found f64");
  expect_error([&] { bias_add(s, y, Tensor()); }, "bias_add: bias [N]: expected a tensor");
  // An f32 bias on f64 rows is accepted, an f64 bias on f32 rows is not (above), nor an i32 one on f64 rows.
  Tensor y64 = Tensor::zeros({4, 3}, DType::F64);
  bias_add(s, y64, bias);
  expect_error([&] { bias_add(s, y64, Tensor::zeros({3}, DType::I32)); },
               "bias_add: bias [N]: expected dtype f32 or y's f64 but found i32");

  Tensor dbias = Tensor::zeros({3}, DType::F32);
  const Tensor dy = Tensor::zeros({4, 3}, DType::F32);
  expect_error([&] { bias_backward(s, Tensor::zeros({3}, DType::F64), dy); },
               "bias_backward: dbias [N]: expected dtype f32 but found f64");
  expect_error([&] { bias_backward(s, Tensor::zeros({3}, DType::F32), dy.to(DType::F64)); },
               "bias_backward: dbias [N]: expected dtype f64 but found f32");
  expect_error([&] { bias_backward(s, Tensor::zeros({4}, DType::F32), dy); },
               "bias_backward: dbias [N]: expected shape [3] but found [4]");
  expect_error(
      [&] {
        bias_backward(s, dbias, Tensor::zeros({2, 2, 3}, DType::F32));
      },
      "bias_backward: expected dy [R, N] but found f32[2, 2, 3]");
  expect_error([&] { bias_backward(s, dbias, Tensor()); }, "bias_backward: dy: expected a tensor");
}

TEST(GroupedBias, RejectsBadArgumentsAndOffsets) {
  Stream& s = Stream::cpu();
  Tensor y = Tensor::zeros({5, 3}, DType::F32);
  const Tensor bias = Tensor::zeros({2, 3}, DType::F32);
  const Tensor good = offsets_of({0, 2, 5});
  expect_error([&] { grouped_bias_add(s, y, Tensor::zeros({3}, DType::F32), good); },
               "grouped_bias_add: expected bias [G, N] but found f32[3]");
  expect_error(
      [&] {
        grouped_bias_add(s, y, Tensor::zeros({2, 4}, DType::F32), good);
      },
      "grouped_bias_add: bias [G, N]: expected shape [2, 3] but found [2, 4]");
  expect_error([&] { grouped_bias_add(s, y, bias.to(DType::F64), good); },
               "grouped_bias_add: bias [G, N]: expected dtype f32 but found f64");
  expect_error(
      [&] {
        grouped_bias_add(s, y, bias, offsets_of({0, 5}));
      },
      "grouped_bias_add: offsets: expected shape [3] but found [2]");
  expect_error([&] { grouped_bias_add(s, y, bias, Tensor::zeros({3}, DType::I64)); },
               "grouped_bias_add: offsets: expected dtype i32 but found i64");
  expect_error(
      [&] {
        grouped_bias_add(s, y, bias, offsets_of({1, 2, 5}));
      },
      "grouped_bias_add: offsets[0] must be 0 but found 1");
  expect_error(
      [&] {
        grouped_bias_add(s, y, bias, offsets_of({0, 3, 2}));
      },
      "grouped_bias_add: offsets must not decrease but offsets[2] = 2 follows offsets[1] = 3");
  expect_error(
      [&] {
        grouped_bias_add(s, y, bias, offsets_of({0, 2, 4}));
      },
      "grouped_bias_add: the last offset offsets[2] must equal the row count R = 5 but found 4");

  Tensor dbias = Tensor::zeros({2, 3}, DType::F32);
  const Tensor dy = Tensor::zeros({5, 3}, DType::F32);
  expect_error([&] { grouped_bias_backward(s, Tensor::zeros({6}, DType::F32), dy, good); },
               "grouped_bias_backward: expected dbias [G, N] but found f32[6]");
  expect_error(
      [&] {
        grouped_bias_backward(s, Tensor::zeros({2, 3}, DType::F64), dy, good);
      },
      "grouped_bias_backward: dbias [G, N]: expected dtype f32 but found f64");
  expect_error(
      [&] {
        grouped_bias_backward(s, Tensor::zeros({2, 2}, DType::F32), dy, good);
      },
      "grouped_bias_backward: dbias [G, N]: expected shape [2, 3] but found [2, 2]");
  expect_error(
      [&] {
        grouped_bias_backward(s, dbias, dy, offsets_of({0, 6, 5}));
      },
      "grouped_bias_backward: offsets must not decrease but offsets[2] = 5 follows offsets[1] = 6");
  expect_error(
      [&] {
        grouped_bias_backward(s, dbias, dy, offsets_of({0, 2, 7}));
      },
      "grouped_bias_backward: the last offset offsets[2] must equal the row count R = 5 but found 7");
  expect_error([&] { grouped_bias_backward(s, dbias, dy.to(DType::I32), good); },
               "grouped_bias_backward: expected dy in f32 or f64 but found i32[5, 3]");
}

}  // namespace
}  // namespace moetrain::ops
