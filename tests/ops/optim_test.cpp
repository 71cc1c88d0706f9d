// Tests for ops/optim: AdamW against a transcription of PyTorch's formulas (hand-checked first step, several steps,
// with and without weight decay, f32 element math), the global norm, clipping, and argument checks.
#include "ops/optim.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::random_tensor;

template <typename F>
void expect_error_containing(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected a moetrain::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos) << "message '" << message << "' lacks '" << needle << "'";
    }
  }
}

// The AdamW update of torch.optim.AdamW written out plainly, one element, in T, with the scalars in double.
template <typename T>
void reference_adamw(T& p, T& m, T& v, T g, const ops::AdamWParams& a) {
  p = p * static_cast<T>(1.0 - a.lr * a.weight_decay);
  m = m + static_cast<T>(1.0 - a.beta1) * (g - m);
  v = v * static_cast<T>(a.beta2) + static_cast<T>(1.0 - a.beta2) * (g * g);
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(a.step));
  const double step_size = a.lr / bc1;
  const T denom = std::sqrt(v) / static_cast<T>(std::sqrt(bc2)) + static_cast<T>(a.eps);
  p = p - static_cast<T>(step_size) * (m / denom);
}

TEST(AdamW, FirstStepMatchesHandComputation) {
  // Step 1 from zero state: m = 0.1 g, v = 0.001 g^2, bias corrections 0.1 and 0.001, so the update is
  // lr * g / (|g| + eps): p = 1 - 0.1 * 0.5 / (0.5 + 1e-8).
  Tensor p = Tensor::from_vector<double>({1.0}, {1});
  Tensor m = Tensor::zeros({1}, DType::F64), v = Tensor::zeros({1}, DType::F64);
  const Tensor g = Tensor::from_vector<double>({0.5}, {1});
  ops::AdamWParams params;
  params.lr = 0.1;
  params.eps = 1e-8;
  ops::adamw_step(Stream::cpu(), p, m, v, g, params);
  EXPECT_NEAR(p.data<double>()[0], 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);
  EXPECT_NEAR(m.data<double>()[0], 0.05, 1e-16);
  EXPECT_NEAR(v.data<double>()[0], 0.00025, 1e-18);
}

TEST(AdamW, TwoStepsMatchTranscribedFormulas) {
  for (double weight_decay : {0.0, 0.1}) {
    for (int64_t first_step : {int64_t{1}, int64_t{7}}) {
      SCOPED_TRACE(::testing::Message() << "weight_decay " << weight_decay << " first step " << first_step);
      Rng rng(21);
      Tensor p = random_tensor({4, 5}, DType::F64, rng);
      Tensor m = random_tensor({4, 5}, DType::F64, rng, 0.1);
      Tensor v = random_tensor({4, 5}, DType::F64, rng, 0.1);
      for (int64_t i = 0; i < v.numel(); ++i) v.data<double>()[i] = std::fabs(v.data<double>()[i]);
      std::vector<double> rp = p.to_vector<double>(), rm = m.to_vector<double>(), rv = v.to_vector<double>();
      ops::AdamWParams params;
      params.lr = 3e-3;
      params.beta1 = 0.9;
      params.beta2 = 0.95;
      params.eps = 1e-8;
      params.weight_decay = weight_decay;
      for (int64_t step = first_step; step < first_step + 2; ++step) {
        const Tensor g = random_tensor({4, 5}, DType::F64, rng);
        params.step = step;
        ops::adamw_step(Stream::cpu(), p, m, v, g, params);
        for (int64_t i = 0; i < p.numel(); ++i) reference_adamw(rp[i], rm[i], rv[i], g.data<double>()[i], params);
      }
      for (int64_t i = 0; i < p.numel(); ++i) {
        EXPECT_NEAR(p.data<double>()[i], rp[i], 1e-15 * std::fabs(rp[i])) << i;
        EXPECT_NEAR(m.data<double>()[i], rm[i], 1e-15 * std::fabs(rm[i])) << i;
        EXPECT_NEAR(v.data<double>()[i], rv[i], 1e-15 * std::fabs(rv[i])) << i;
      }
    }
  }
}

TEST(AdamW, Float32ElementMathIsDoneInFloat) {
  Rng rng(22);
  Tensor p = random_tensor({64}, DType::F32, rng);
  Tensor m = Tensor::zeros({64}, DType::F32), v = Tensor::zeros({64}, DType::F32);
  std::vector<float> rp = p.to_vector<float>(), rm(64, 0.0f), rv(64, 0.0f);
  ops::AdamWParams params;
  params.lr = 1e-2;
  params.weight_decay = 0.01;
  for (int64_t step = 1; step <= 3; ++step) {
    const Tensor g = random_tensor({64}, DType::F32, rng);
    params.step = step;
    ops::adamw_step(Stream::cpu(), p, m, v, g, params);
    for (int64_t i = 0; i < 64; ++i) reference_adamw(rp[i], rm[i], rv[i], g.data<float>()[i], params);
  }
  // beta1 = 0.9: PyTorch's lerp takes the m + w * (g - m) branch, so the float results agree bit for bit.
  EXPECT_EQ(std::memcmp(p.raw_data(), rp.data(), p.nbytes()), 0);
  EXPECT_EQ(std::memcmp(m.raw_data(), rm.data(), m.nbytes()), 0);
  EXPECT_EQ(std::memcmp(v.raw_data(), rv.data(), v.nbytes()), 0);
}

TEST(AdamW, RejectsBadArguments) {
  Tensor p = Tensor::zeros({3}, DType::F32), m = Tensor::zeros({3}, DType::F32), v = Tensor::zeros({3}, DType::F32);
  const Tensor g = Tensor::zeros({3}, DType::F32);
  ops::AdamWParams params;
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m, v, Tensor::zeros({4}, DType::F32), params); },
                          {"grad", "expected shape [3]", "found [4]"});
  Tensor m64 = Tensor::zeros({3}, DType::F64);
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m64, v, g, params); },
                          {"exp_avg", "expected dtype f32", "found f64"});
  Tensor p16 = Tensor::zeros({3}, DType::BF16);
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p16, m, v, g, params); },
                          {"param", "f32 or f64", "bf16"});
  params.step = 0;
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"step >= 1", "found 0"});
  params.step = 1;
  params.beta2 = 1.0;
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"beta2", "found 1"});
  params.beta2 = 0.999;
  params.lr = -1.0;
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"lr >= 0", "found -1"});
  params.lr = 1e-3;
  params.weight_decay = -0.1;
  expect_error_containing([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"weight_decay"});
}

TEST(GlobalNorm, IsRootOfSummedSquaresOverTensors) {
  const Tensor a = Tensor::from_vector<float>({3.0f, 4.0f}, {2});
  const Tensor b = Tensor::from_vector<double>({12.0}, {1, 1});
  EXPECT_EQ(ops::sum_of_squares(Stream::cpu(), a), 25.0);
  EXPECT_EQ(ops::global_norm(Stream::cpu(), {a, b}), 13.0);
  EXPECT_EQ(ops::global_norm(Stream::cpu(), {}), 0.0);
  Rng rng(23);
  const Tensor r = random_tensor({100}, DType::F32, rng);
  double expected = 0.0;  // f64 in ascending order
  for (int64_t i = 0; i < 100; ++i) expected += double(r.data<float>()[i]) * double(r.data<float>()[i]);
  EXPECT_EQ(ops::sum_of_squares(Stream::cpu(), r), expected);
}

TEST(ClipByGlobalNorm, ScalesEveryTensorByTheCoefficient) {
  Tensor a = Tensor::from_vector<float>({3.0f, 4.0f}, {2});
  Tensor b = Tensor::from_vector<double>({12.0}, {1});
  const double norm = ops::clip_by_global_norm(Stream::cpu(), {a, b}, 1.0);
  EXPECT_EQ(norm, 13.0);
  const double coefficient = 1.0 / (13.0 + 1e-6);
  EXPECT_EQ(a.data<float>()[0], 3.0f * static_cast<float>(coefficient));
  EXPECT_EQ(a.data<float>()[1], 4.0f * static_cast<float>(coefficient));
  EXPECT_EQ(b.data<double>()[0], 12.0 * coefficient);
  EXPECT_NEAR(ops::global_norm(Stream::cpu(), {a, b}), 1.0, 1e-6);
}

TEST(ClipByGlobalNorm, LeavesTensorsUnderTheMaximumUnchanged) {
  Tensor a = Tensor::from_vector<float>({0.3f, -0.4f}, {2});
  const std::vector<float> before = a.to_vector<float>();
  EXPECT_NEAR(ops::clip_by_global_norm(Stream::cpu(), {a}, 1.0), 0.5, 1e-7);
  EXPECT_EQ(a.to_vector<float>(), before);
}

TEST(ClipByGlobalNorm, NonPositiveMaximumDisablesClippingButReturnsTheNorm) {
  Tensor a = Tensor::from_vector<float>({30.0f, 40.0f}, {2});
  EXPECT_EQ(ops::clip_by_global_norm(Stream::cpu(), {a}, 0.0), 50.0);
  EXPECT_EQ(ops::clip_by_global_norm(Stream::cpu(), {a}, -1.0), 50.0);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{30.0f, 40.0f}));
}

TEST(ClipByGlobalNorm, RejectsBadTensorWithoutTouchingAny) {
  Tensor a = Tensor::from_vector<float>({30.0f, 40.0f}, {2});
  const Tensor bad = Tensor::zeros({2}, DType::I32);
  expect_error_containing(
      [&] {
        ops::clip_by_global_norm(Stream::cpu(), {a, bad}, 1.0);
      },
      {"grads[1]", "f32 or f64", "i32"});
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{30.0f, 40.0f}));
  expect_error_containing([&] { ops::global_norm(Stream::cpu(), {a, Tensor()}); }, {"tensors[1]", "undefined"});
}

}  // namespace
}  // namespace moetrain
