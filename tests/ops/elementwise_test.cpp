// Tests for ops/elementwise: add (aliasing too), accumulate, scale, casts between f64 / f32 / bf16 with
// round-to-nearest-even, in-place bf16 rounding, and argument checks.
#include "ops/elementwise.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;

TEST(Elementwise, AddMatchesElementSums) {
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(31);
    const Tensor a = random_tensor({3, 7}, dtype, rng), b = random_tensor({3, 7}, dtype, rng);
    Tensor out = Tensor::empty({3, 7}, dtype);
    ops::add_forward(Stream::cpu(), out, a, b);
    const std::vector<double> va = a.to(DType::F64).to_vector<double>(), vb = b.to(DType::F64).to_vector<double>();
    const std::vector<double> vo = out.to(DType::F64).to_vector<double>();
    for (size_t i = 0; i < va.size(); ++i) {
      const double expected = dtype == DType::F32 ? double(float(va[i]) + float(vb[i])) : va[i] + vb[i];
      EXPECT_EQ(vo[i], expected) << i;
    }
  }
}

TEST(Elementwise, AddMayWriteIntoAnInput) {
  Rng rng(32);
  const Tensor a = random_tensor({10}, DType::F32, rng), b = random_tensor({10}, DType::F32, rng);
  Tensor expected = Tensor::empty({10}, DType::F32);
  ops::add_forward(Stream::cpu(), expected, a, b);
  Tensor into_a = a.clone();
  ops::add_forward(Stream::cpu(), into_a, into_a, b);
  Tensor into_b = b.clone();
  ops::add_forward(Stream::cpu(), into_b, a, into_b);
  EXPECT_EQ(into_a.to_vector<float>(), expected.to_vector<float>());
  EXPECT_EQ(into_b.to_vector<float>(), expected.to_vector<float>());
}

TEST(Elementwise, AccumulateAndScaleInPlace) {
  Tensor acc = Tensor::from_vector<double>({1.0, 2.0, 3.0}, {3});
  ops::accumulate(Stream::cpu(), acc, Tensor::from_vector<double>({0.5, -2.0, 10.0}, {3}));
  EXPECT_EQ(acc.to_vector<double>(), (std::vector<double>{1.5, 0.0, 13.0}));
  ops::scale_inplace(Stream::cpu(), acc, -2.0);
  EXPECT_EQ(acc.to_vector<double>(), (std::vector<double>{-3.0, -0.0, -26.0}));
  Tensor f = Tensor::from_vector<float>({1.0f, 3.0f}, {2});
  ops::scale_inplace(Stream::cpu(), f, 0.1);  // the factor is rounded to f32 first, as torch's mul_ does
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{0.1f, 3.0f * 0.1f}));
}

TEST(Cast, RoundTripsThroughWiderTypes) {
  Rng rng(33);
  const Tensor f32 = random_tensor({50}, DType::F32, rng);
  Tensor f64 = Tensor::empty({50}, DType::F64);
  ops::cast(Stream::cpu(), f64, f32);
  Tensor back = Tensor::empty({50}, DType::F32);
  ops::cast(Stream::cpu(), back, f64);
  EXPECT_EQ(std::memcmp(back.raw_data(), f32.raw_data(), f32.nbytes()), 0);

  // Every bf16 value survives bf16 -> f32 -> bf16 and bf16 -> f64 -> bf16.
  Tensor bf16 = Tensor::empty({50}, DType::BF16);
  ops::cast(Stream::cpu(), bf16, f32);
  for (DType wide : {DType::F32, DType::F64}) {
    Tensor w = Tensor::empty({50}, wide);
    ops::cast(Stream::cpu(), w, bf16);
    Tensor again = Tensor::empty({50}, DType::BF16);
    ops::cast(Stream::cpu(), again, w);
    EXPECT_EQ(std::memcmp(again.raw_data(), bf16.raw_data(), bf16.nbytes()), 0) << dtype_name(wide);
  }
}

TEST(Cast, RoundsToNearestEvenBf16) {
  // bf16 keeps 7 mantissa bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (ties to the even 1), 1 + 3 * 2^-8 is
  // halfway between 1 + 2^-7 and 1 + 2^-6 (ties to the even 1 + 2^-6), and just above a half rounds up.
  const std::vector<float> in = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -(1.0f + 0x1p-8f),
                                 3.0f};
  const std::vector<float> expected = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -1.0f, 3.0f};
  Tensor bf16 = Tensor::empty({5}, DType::BF16);
  ops::cast(Stream::cpu(), bf16, Tensor::from_vector<float>(in, {5}));
  Tensor out = Tensor::empty({5}, DType::F32);
  ops::cast(Stream::cpu(), out, bf16);
  EXPECT_EQ(out.to_vector<float>(), expected);
  // The same values from f64 and back to f64.
  std::vector<double> in64(in.begin(), in.end());
  Tensor bf16_from64 = Tensor::empty({5}, DType::BF16);
  ops::cast(Stream::cpu(), bf16_from64, Tensor::from_vector<double>(in64, {5}));
  Tensor out64 = Tensor::empty({5}, DType::F64);
  ops::cast(Stream::cpu(), out64, bf16_from64);
  EXPECT_EQ(out64.to_vector<double>(), std::vector<double>(expected.begin(), expected.end()));
}

TEST(Cast, RoundToBf16InPlaceMatchesCastThroughBf16) {
  Rng rng(34);
  Tensor x = random_tensor({200}, DType::F32, rng, 10.0);
  Tensor bf16 = Tensor::empty({200}, DType::BF16);
  ops::cast(Stream::cpu(), bf16, x);
  Tensor expected = Tensor::empty({200}, DType::F32);
  ops::cast(Stream::cpu(), expected, bf16);
  ops::round_to_bf16_inplace(Stream::cpu(), x);
  EXPECT_EQ(std::memcmp(x.raw_data(), expected.raw_data(), x.nbytes()), 0);
  for (float v : x.to_vector<float>()) EXPECT_EQ(round_to_bf16(v), v);  // already bf16 values
}

TEST(Cast, InDtypeReturnsTheTensorItselfOrItsCast) {
  Rng rng(8);
  const Tensor x = random_tensor({3, 5}, DType::F32, rng);
  const Tensor same = ops::in_dtype(Stream::cpu(), x, DType::F32);
  EXPECT_EQ(same.raw_data(), x.raw_data());  // no copy
  const Tensor wide = ops::in_dtype(Stream::cpu(), x, DType::F64);
  ASSERT_EQ(wide.dtype(), DType::F64);
  Tensor want = Tensor::empty({3, 5}, DType::F64);
  ops::cast(Stream::cpu(), want, x);
  EXPECT_EQ(std::memcmp(wide.raw_data(), want.raw_data(), want.nbytes()), 0);
  EXPECT_NE(wide.raw_data(), x.raw_data());
}

TEST(Elementwise, RejectsBadArguments) {
  const Tensor a = Tensor::zeros({2, 3}, DType::F32);
  Tensor out = Tensor::zeros({2, 3}, DType::F32);
  expect_error(
      [&] {
        ops::add_forward(Stream::cpu(), out, a, Tensor::zeros({3, 2}, DType::F32));
      },
      {"add_forward: b", "expected shape [2, 3]", "found [3, 2]"});
  expect_error(
      [&] {
        ops::add_forward(Stream::cpu(), out, a, Tensor::zeros({2, 3}, DType::F64));
      },
      {"add_forward: b", "expected dtype f32", "found f64"});
  Tensor i32 = Tensor::zeros({2, 3}, DType::I32);
  expect_error([&] { ops::scale_inplace(Stream::cpu(), i32, 2.0); }, {"scale_inplace", "f32 or f64", "i32"});
  expect_error([&] { ops::accumulate(Stream::cpu(), out, Tensor::zeros({6}, DType::F32)); },
               {"accumulate: x", "expected shape [2, 3]", "found [6]"});
  Tensor bf16 = Tensor::zeros({2, 3}, DType::BF16);
  expect_error([&] { ops::add_forward(Stream::cpu(), bf16, bf16, bf16); }, {"f32 or f64", "bf16"});
  Tensor f16 = Tensor::zeros({2, 3}, DType::F16);
  expect_error([&] { ops::cast(Stream::cpu(), f16, a); }, {"cast: expected out", "f16"});
  expect_error([&] { ops::cast(Stream::cpu(), out, Tensor::zeros({6}, DType::F64)); },
               {"cast: out", "expected shape [6]", "found [2, 3]"});
  Tensor f64 = Tensor::zeros({2}, DType::F64);
  expect_error([&] { ops::round_to_bf16_inplace(Stream::cpu(), f64); },
               {"round_to_bf16_inplace: x", "expected dtype f32", "found f64"});
}

}  // namespace
}  // namespace moetrain
