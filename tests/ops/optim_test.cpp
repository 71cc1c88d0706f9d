// Tests for ops/optim: AdamW against a transcription of PyTorch's formulas (hand-checked first step, several steps,
// with and without weight decay, f32 element math), moments kept in bf16 against the f32 step rounded, the
// multi-tensor AdamW against the per-tensor one (bitwise, with its compute copies against a cast), the global norm,
// clipping, and argument checks.
#include "ops/optim.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "ops/elementwise.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;

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
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m, v, Tensor::zeros({4}, DType::F32), params); },
               {"grad", "expected shape [3]", "found [4]"});
  Tensor m64 = Tensor::zeros({3}, DType::F64);
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m64, v, g, params); },
               {"exp_avg", "in f32 (the param's dtype) or in bf16 under an f32 param", "found f64"});
  // Moments kept in bf16: both, and under an f32 param only.
  Tensor m16 = Tensor::zeros({3}, DType::BF16);
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m16, v, g, params); },
               {"exp_avg_sq", "expected dtype bf16", "found f32"});
  Tensor p64 = Tensor::zeros({3}, DType::F64), g64 = Tensor::zeros({3}, DType::F64);
  expect_error([&] { ops::adamw_step(Stream::cpu(), p64, m16, m16, g64, params); },
               {"exp_avg", "in f64 (the param's dtype) or in bf16 under an f32 param", "found bf16"});
  Tensor p16 = Tensor::zeros({3}, DType::BF16);
  expect_error([&] { ops::adamw_step(Stream::cpu(), p16, m, v, g, params); }, {"param", "f32 or f64", "bf16"});
  params.step = 0;
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"step >= 1", "found 0"});
  params.step = 1;
  params.beta2 = 1.0;
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"beta2", "found 1"});
  params.beta2 = 0.999;
  params.lr = -1.0;
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"lr >= 0", "found -1"});
  params.lr = 1e-3;
  params.weight_decay = -0.1;
  expect_error([&] { ops::adamw_step(Stream::cpu(), p, m, v, g, params); }, {"weight_decay"});
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

TEST(ClipCoefficient, IsTorchsCoefficientBelowOneElseOne) {
  EXPECT_EQ(ops::clip_coefficient(13.0, 1.0), 1.0 / (13.0 + 1e-6));
  EXPECT_EQ(ops::clip_coefficient(0.5, 1.0), 1.0);       // under the maximum
  EXPECT_EQ(ops::clip_coefficient(50.0, 0.0), 1.0);      // disabled
  EXPECT_EQ(ops::clip_coefficient(INFINITY, 1.0), 1.0);  // the caller acts on a norm that is not finite
  EXPECT_EQ(ops::clip_coefficient(NAN, 1.0), 1.0);
  EXPECT_THROW(ops::clip_coefficient(1.0, NAN), Error);
}

// AdamW's grad_scale is the clip folded into the update: the same bits as scaling the gradients first (as
// clip_by_global_norm does) and stepping with a scale of 1, while the gradients stay as they were.
TEST(AdamW, GradScaleIsTheClipFoldedIntoTheUpdate) {
  Rng rng(17);
  const Tensor p0 = random_tensor({257}, DType::F32, rng), g = random_tensor({257}, DType::F32, rng, 3.0);
  const double coefficient = ops::clip_coefficient(41.7, 1.0);
  Tensor folded_p = p0.clone(), folded_m = Tensor::zeros({257}, DType::F32), folded_v = folded_m.clone();
  Tensor apart_p = p0.clone(), apart_m = folded_m.clone(), apart_v = folded_m.clone();
  const Tensor g_before = g.clone();
  for (int64_t step = 1; step <= 3; ++step) {
    ops::AdamWParams folded{1e-3, 0.9, 0.95, 1e-8, 0.1, step, coefficient};
    ops::adamw_step(Stream::cpu(), folded_p, folded_m, folded_v, g, folded);
    Tensor scaled = g.clone();
    ops::scale_inplace(Stream::cpu(), scaled, coefficient);  // what clip_by_global_norm does with it
    const ops::AdamWParams apart{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
    ops::adamw_step(Stream::cpu(), apart_p, apart_m, apart_v, scaled, apart);
  }
  EXPECT_EQ(0, std::memcmp(folded_p.raw_data(), apart_p.raw_data(), 257 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(folded_m.raw_data(), apart_m.raw_data(), 257 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(folded_v.raw_data(), apart_v.raw_data(), 257 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(g.raw_data(), g_before.raw_data(), 257 * sizeof(float)));  // left as it was
  for (double bad : {0.0, -0.5, 1.5, static_cast<double>(NAN)}) {
    Tensor p = p0.clone(), m = folded_m.clone(), v = folded_v.clone();
    expect_error(
        [&] {
          ops::adamw_step(Stream::cpu(), p, m, v, g, {1e-3, 0.9, 0.95, 1e-8, 0.0, 1, bad});
        },
        {"grad_scale in (0, 1]"});
  }
}

TEST(ClipByGlobalNorm, RejectsBadTensorWithoutTouchingAny) {
  Tensor a = Tensor::from_vector<float>({30.0f, 40.0f}, {2});
  const Tensor bad = Tensor::zeros({2}, DType::I32);
  expect_error([&] { ops::clip_by_global_norm(Stream::cpu(), {a, bad}, 1.0); }, {"grads[1]", "f32 or f64", "i32"});
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{30.0f, 40.0f}));
  expect_error([&] { ops::global_norm(Stream::cpu(), {a, Tensor()}); }, {"tensors[1]", "undefined"});
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

// Lists of tensors for adamw_step_multi: params, moments (non-zero, as after earlier steps), per-tensor decays.
struct MultiState {
  std::vector<Tensor> params, m, v;
  std::vector<double> decay;
  MultiState clone() const {
    MultiState c;
    for (size_t i = 0; i < params.size(); ++i) {
      c.params.push_back(params[i].clone());
      c.m.push_back(m[i].clone());
      c.v.push_back(v[i].clone());
    }
    c.decay = decay;
    return c;
  }
};

MultiState make_state(const std::vector<Shape>& shapes, DType dtype, Rng& rng) {
  MultiState s;
  for (size_t i = 0; i < shapes.size(); ++i) {
    s.params.push_back(random_tensor(shapes[i], dtype, rng));
    s.m.push_back(random_tensor(shapes[i], dtype, rng, 0.01));
    // exp_avg_sq >= 0: the squares of random values.
    const Tensor r = random_tensor(shapes[i], dtype, rng, 0.1);
    Tensor v = Tensor::empty(shapes[i], dtype);
    for (int64_t k = 0; k < v.numel(); ++k) {
      if (dtype == DType::F32) {
        v.data<float>()[k] = r.data<float>()[k] * r.data<float>()[k];
      } else {
        v.data<double>()[k] = r.data<double>()[k] * r.data<double>()[k];
      }
    }
    s.v.push_back(v);
    s.decay.push_back(i % 3 == 0 ? 0.1 : (i % 3 == 1 ? 0.0 : 0.01));
  }
  return s;
}

// Three steps of adamw_step_multi on `multi` and of adamw_step per tensor on `single` (the same state), with the same
// random gradients in `grad_dtype`; then every param and moment compared bytewise.
void expect_multi_steps_match_per_tensor(MultiState& multi, MultiState& single, const std::vector<Shape>& shapes,
                                         const std::vector<Tensor>& copies, DType grad_dtype, Rng& rng) {
  ops::AdamWParams hyper{3e-3, 0.9, 0.95, 1e-8, /*weight_decay, ignored:*/ 0.5, 1};
  for (int64_t step = 1; step <= 3; ++step) {
    hyper.step = step;
    std::vector<Tensor> grads;
    for (const Shape& shape : shapes) grads.push_back(random_tensor(shape, grad_dtype, rng, 0.1));
    ops::adamw_step_multi(Stream::cpu(), multi.params, multi.m, multi.v, grads, copies, multi.decay, hyper);
    for (size_t i = 0; i < shapes.size(); ++i) {
      ops::AdamWParams p = hyper;
      p.weight_decay = single.decay[i];
      ops::adamw_step(Stream::cpu(), single.params[i], single.m[i], single.v[i], grads[i], p);
    }
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i);
    EXPECT_TRUE(same_bytes(multi.params[i], single.params[i])) << "param";
    EXPECT_TRUE(same_bytes(multi.m[i], single.m[i])) << "exp_avg";
    EXPECT_TRUE(same_bytes(multi.v[i], single.v[i])) << "exp_avg_sq";
  }
}

TEST(AdamWMulti, MatchesPerTensorStepsBitwiseAndWritesTheCopiesAsCast) {
  const std::vector<Shape> shapes{{16, 8}, {8}, {0}, {3, 5, 7}, {1}, {1000}};
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(31);
    MultiState multi = make_state(shapes, dtype, rng);
    MultiState single = multi.clone();
    // Copies: bf16, none (undefined), the param itself, f32 (or f64 of an f32 param), bf16, none.
    std::vector<Tensor> copies(shapes.size());
    copies[0] = Tensor::zeros(shapes[0], DType::BF16);
    copies[2] = multi.params[2];
    copies[3] = Tensor::zeros(shapes[3], dtype == DType::F32 ? DType::F64 : DType::F32);
    copies[4] = multi.params[4];
    copies[5] = Tensor::zeros(shapes[5], DType::BF16);
    expect_multi_steps_match_per_tensor(multi, single, shapes, copies, dtype, rng);
    for (size_t i : {size_t(0), size_t(3), size_t(5)}) {
      EXPECT_TRUE(same_bytes(copies[i], single.params[i].to(copies[i].dtype()))) << "copy of tensor " << i;
    }
  }
}

// Moments kept in bf16 (optim.state_dtype = bf16): each step is the f32 step from the stored moments widened, with
// the moments rounded to nearest even as they are stored; the param's update used them unrounded.
TEST(AdamW, Bf16MomentsAreTheF32StepWithTheMomentsRoundedWhenStored) {
  for (const double grad_scale : {1.0, 0.37}) {
    SCOPED_TRACE(::testing::Message() << "grad_scale " << grad_scale);
    Rng rng(23);
    Tensor p = random_tensor({6, 7}, DType::F32, rng);
    Tensor m = random_tensor({6, 7}, DType::F32, rng, 0.01).to(DType::BF16);
    Tensor v = Tensor::zeros({6, 7}, DType::BF16);
    for (int64_t step = 1; step <= 4; ++step) {
      const Tensor g = random_tensor({6, 7}, DType::F32, rng, 0.1);
      const ops::AdamWParams params{1e-2, 0.9, 0.95, 1e-8, 0.1, step, grad_scale};
      Tensor want_p = p.clone(), want_m = m.to(DType::F32), want_v = v.to(DType::F32);
      ops::adamw_step(Stream::cpu(), want_p, want_m, want_v, g, params);
      ops::adamw_step(Stream::cpu(), p, m, v, g, params);
      EXPECT_TRUE(same_bytes(p, want_p)) << "param at step " << step;
      EXPECT_TRUE(same_bytes(m, want_m.to(DType::BF16))) << "exp_avg at step " << step;
      EXPECT_TRUE(same_bytes(v, want_v.to(DType::BF16))) << "exp_avg_sq at step " << step;
    }
    // The moments moved off their start: the test compared real updates.
    EXPECT_GT(v.to(DType::F32).to_vector<float>()[0], 0.0f);
  }
}

TEST(AdamWMulti, Bf16MomentsMatchPerTensorStepsBitwise) {
  const std::vector<Shape> shapes{{16, 8}, {8}, {0}, {1000}};
  Rng rng(34);
  MultiState multi = make_state(shapes, DType::F32, rng);
  for (size_t i = 0; i < shapes.size(); ++i) {
    multi.m[i] = multi.m[i].to(DType::BF16);
    multi.v[i] = multi.v[i].to(DType::BF16);
  }
  MultiState single = multi.clone();
  std::vector<Tensor> copies{Tensor::zeros(shapes[0], DType::BF16), Tensor(), Tensor(),
                             Tensor::zeros(shapes[3], DType::BF16)};
  expect_multi_steps_match_per_tensor(multi, single, shapes, copies, DType::F32, rng);
  for (const Tensor& m : multi.m) EXPECT_EQ(m.dtype(), DType::BF16);
  EXPECT_TRUE(same_bytes(copies[3], single.params[3].to(DType::BF16)));
  // A list's moments share one dtype (one CUDA launch reads them all alike).
  const ops::AdamWParams hyper;
  std::vector<Tensor> mixed_m = multi.m, mixed_v = multi.v;
  mixed_m[1] = Tensor::zeros(shapes[1], DType::F32);
  mixed_v[1] = Tensor::zeros(shapes[1], DType::F32);
  std::vector<Tensor> grads;
  for (const Shape& shape : shapes) grads.push_back(Tensor::zeros(shape, DType::F32));
  expect_error(
      [&] { ops::adamw_step_multi(Stream::cpu(), multi.params, mixed_m, mixed_v, grads, {}, multi.decay, hyper); },
      {"adamw_step_multi", "every moment in bf16", "f32[8]"});
}

TEST(AdamWMulti, EmptyCopyListAndEmptyParamListAreAccepted) {
  Rng rng(32);
  MultiState multi = make_state({{4, 4}, {4}}, DType::F32, rng);
  MultiState single = multi.clone();
  const std::vector<Tensor> grads{random_tensor({4, 4}, DType::F32, rng), random_tensor({4}, DType::F32, rng)};
  const ops::AdamWParams hyper{1e-2, 0.9, 0.999, 1e-8, 0.0, 4};
  ops::adamw_step_multi(Stream::cpu(), multi.params, multi.m, multi.v, grads, {}, multi.decay, hyper);
  for (size_t i = 0; i < 2; ++i) {
    ops::AdamWParams p = hyper;
    p.weight_decay = single.decay[i];
    ops::adamw_step(Stream::cpu(), single.params[i], single.m[i], single.v[i], grads[i], p);
    EXPECT_TRUE(same_bytes(multi.params[i], single.params[i])) << i;
  }
  ops::adamw_step_multi(Stream::cpu(), {}, {}, {}, {}, {}, {}, hyper);
}

TEST(AdamWMulti, RejectsBadArguments) {
  Rng rng(33);
  MultiState s = make_state({{2, 3}, {3}}, DType::F32, rng);
  const std::vector<Tensor> grads{Tensor::zeros({2, 3}, DType::F32), Tensor::zeros({3}, DType::F32)};
  const ops::AdamWParams hyper;
  Stream& cpu = Stream::cpu();
  expect_error([&] { ops::adamw_step_multi(cpu, s.params, s.m, s.v, {grads[0]}, {}, s.decay, hyper); },
               {"adamw_step_multi", "2 params", "found 2, 2, 1 and 2"});
  expect_error([&] { ops::adamw_step_multi(cpu, s.params, s.m, s.v, grads, {Tensor()}, s.decay, hyper); },
               {"adamw_step_multi", "compute_copies", "(2)", "found 1"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, s.params, s.m, s.v, {grads[0], Tensor::zeros({4}, DType::F32)}, {}, s.decay, hyper);
      },
      {"grads[1]", "expected shape [3]", "found [4]"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, s.params, s.m, s.v, grads, {}, {0.1, -0.1}, hyper);
      },
      {"weight_decay[1] >= 0", "found -0.1"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, s.params, s.m, s.v, grads, {Tensor(), Tensor::zeros({4}, DType::BF16)}, s.decay,
                              hyper);
      },
      {"compute_copies[1]", "expected shape [3]", "found [4]"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, s.params, s.m, s.v, grads, {Tensor(), Tensor::zeros({3}, DType::I32)}, s.decay,
                              hyper);
      },
      {"compute_copies[1]", "bf16, f32 or f64", "i32"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, {s.params[0], s.params[0]}, {s.m[0], s.m[1]}, {s.v[0], s.v[0]}, {grads[0], grads[0]},
                              {}, s.decay, hyper);
      },
      {"exp_avg[1]", "expected shape [2, 3]", "found [3]"});
  expect_error(
      [&] {
        ops::adamw_step_multi(cpu, {s.params[0], s.params[0]}, {s.m[0], s.m[0]}, {s.v[0], s.v[0]}, {grads[0], grads[0]},
                              {}, s.decay, hyper);
      },
      {"adamw_step_multi", "distinct params"});
  ops::AdamWParams bad = hyper;
  bad.step = 0;
  expect_error([&] { ops::adamw_step_multi(cpu, s.params, s.m, s.v, grads, {}, s.decay, bad); },
               {"adamw_step_multi", "step >= 1", "found 0"});
}

}  // namespace
}  // namespace moetrain
