// Tests for ops/norm: RMSNorm forward against a direct computation, input and weight gradients against finite
// differences (plain and zero-centred), accumulation into dw, batch invariance and argument checks; the whole backward
// in one op against the input and weight gradient ops (bitwise) and its argument checks; the fused residual add +
// RMSNorm against add_forward then rmsnorm_forward (bitwise), in place, and its argument checks.
#include "ops/norm.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "core/rng.h"
#include "ops/elementwise.h"
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
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

// y and rstd of rows of length D computed in double, straight from the definition.
void reference_rmsnorm(const std::vector<float>& x, const std::vector<float>& w, int64_t dim, float eps,
                       bool zero_centered, std::vector<double>* y, std::vector<double>* rstd) {
  const int64_t rows = static_cast<int64_t>(x.size()) / dim;
  y->assign(x.size(), 0.0);
  rstd->assign(static_cast<size_t>(rows), 0.0);
  for (int64_t n = 0; n < rows; ++n) {
    double sum_sq = 0.0;
    for (int64_t d = 0; d < dim; ++d) sum_sq += double(x[n * dim + d]) * x[n * dim + d];
    const double r = 1.0 / std::sqrt(sum_sq / double(dim) + double(eps));
    (*rstd)[n] = r;
    for (int64_t d = 0; d < dim; ++d) {
      const double scale = zero_centered ? 1.0 + double(w[d]) : double(w[d]);
      (*y)[n * dim + d] = double(x[n * dim + d]) * r * scale;
    }
  }
}

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return std::sqrt(diff / ref);
}

TEST(RmsNorm, ForwardMatchesDirectComputation) {
  for (bool zero_centered : {false, true}) {
    SCOPED_TRACE(zero_centered ? "zero-centred" : "plain");
    Rng rng(1);
    // The per-head q/k norm shape: x [T, nh, hd], w [hd].
    const Tensor x = random_tensor({3, 4, 32}, DType::F32, rng);
    const Tensor w = random_tensor({32}, DType::F32, rng, 0.5);
    Tensor y = Tensor::empty({3, 4, 32}, DType::F32);
    Tensor rstd = Tensor::empty({12}, DType::F32);
    const RmsNormParams params{1e-6f, zero_centered};
    rmsnorm_forward(Stream::cpu(), y, rstd, x, w, params);

    std::vector<double> want_y, want_rstd;
    reference_rmsnorm(x.to_vector<float>(), w.to_vector<float>(), 32, params.eps, zero_centered, &want_y, &want_rstd);
    EXPECT_LT(relative_error(y.to_vector<float>(), want_y), 1e-6);
    EXPECT_LT(relative_error(rstd.to_vector<float>(), want_rstd), 1e-6);
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  for (bool zero_centered : {false, true}) {
    SCOPED_TRACE(zero_centered ? "zero-centred" : "plain");
    Rng rng(2);
    const int64_t rows = 5, dim = 8;
    Tensor x = random_tensor({rows, dim}, DType::F64, rng);
    Tensor w = random_tensor({dim}, DType::F64, rng, 0.5);
    const Tensor g = random_tensor({rows, dim}, DType::F64, rng);  // loss = <y, g>, so dy = g
    const RmsNormParams params{1e-5f, zero_centered};

    Tensor y = Tensor::empty({rows, dim}, DType::F64);
    Tensor rstd = Tensor::empty({rows}, DType::F64);
    auto loss = [&] {
      rmsnorm_forward(Stream::cpu(), y, rstd, x, w, params);
      return testing::dot(y, g);
    };
    loss();
    Tensor dx = Tensor::empty({rows, dim}, DType::F64);
    Tensor dw = Tensor::zeros({dim}, DType::F64);
    rmsnorm_backward_input(Stream::cpu(), dx, g, x, w, rstd, params);
    rmsnorm_backward_weight(Stream::cpu(), dw, g, x, rstd);
    testing::expect_gradients_match(loss, {{"x", x, dx}, {"w", w, dw}});
  }
}

TEST(RmsNorm, BackwardInputMayOverwriteDy) {
  Rng rng(3);
  const Tensor x = random_tensor({4, 16}, DType::F32, rng);
  const Tensor w = random_tensor({16}, DType::F32, rng);
  const Tensor dy = random_tensor({4, 16}, DType::F32, rng);
  Tensor y = Tensor::empty({4, 16}, DType::F32);
  Tensor rstd = Tensor::empty({4}, DType::F32);
  const RmsNormParams params;
  rmsnorm_forward(Stream::cpu(), y, rstd, x, w, params);

  Tensor dx = Tensor::empty({4, 16}, DType::F32);
  rmsnorm_backward_input(Stream::cpu(), dx, dy, x, w, rstd, params);
  Tensor in_place = dy.clone();
  rmsnorm_backward_input(Stream::cpu(), in_place, in_place, x, w, rstd, params);
  EXPECT_TRUE(bitwise_equal(in_place, dx));
}

TEST(RmsNorm, BackwardWeightAccumulatesIntoDw) {
  Rng rng(4);
  const Tensor x = random_tensor({6, 8}, DType::F64, rng);
  const Tensor w = random_tensor({8}, DType::F64, rng);
  const Tensor dy = random_tensor({6, 8}, DType::F64, rng);
  Tensor y = Tensor::empty({6, 8}, DType::F64);
  Tensor rstd = Tensor::empty({6}, DType::F64);
  rmsnorm_forward(Stream::cpu(), y, rstd, x, w, {});

  const Tensor start = random_tensor({8}, DType::F64, rng);
  Tensor dw = start.clone();
  rmsnorm_backward_weight(Stream::cpu(), dw, dy, x, rstd);
  rmsnorm_backward_weight(Stream::cpu(), dw, dy, x, rstd);  // a second micro-batch adds again

  const auto xv = x.to_vector<double>(), dyv = dy.to_vector<double>(), rv = rstd.to_vector<double>();
  const auto sv = start.to_vector<double>(), got = dw.to_vector<double>();
  for (int64_t d = 0; d < 8; ++d) {
    double sum = 0.0;
    for (int64_t n = 0; n < 6; ++n) sum += dyv[n * 8 + d] * xv[n * 8 + d] * rv[n];
    EXPECT_NEAR(got[d], sv[d] + 2.0 * sum, 1e-12) << "d = " << d;
  }
}

TEST(RmsNorm, RowsAreBatchInvariantAndThreadCountInvariant) {
  Rng rng(5);
  const int64_t dim = 200;
  const Tensor x17 = random_tensor({17, dim}, DType::F32, rng);
  const Tensor x3 = x17.slice(0, 3).clone();
  const Tensor w = random_tensor({dim}, DType::F32, rng);
  const Tensor dy17 = random_tensor({17, dim}, DType::F32, rng);
  const Tensor dy3 = dy17.slice(0, 3).clone();
  const RmsNormParams params;

  struct Outputs {
    Tensor y, rstd, dx, dw;
  };
  auto run = [&](const Tensor& x, const Tensor& dy) {
    const int64_t rows = x.size(0);
    Outputs o{Tensor::empty({rows, dim}, DType::F32), Tensor::empty({rows}, DType::F32),
              Tensor::empty({rows, dim}, DType::F32), Tensor::zeros({dim}, DType::F32)};
    rmsnorm_forward(Stream::cpu(), o.y, o.rstd, x, w, params);
    rmsnorm_backward_input(Stream::cpu(), o.dx, dy, x, w, o.rstd, params);
    rmsnorm_backward_weight(Stream::cpu(), o.dw, dy, x, o.rstd);
    return o;
  };

  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(2);
  const Outputs big = run(x17, dy17);
  const Outputs small = run(x3, dy3);
  omp_set_num_threads(1);
  const Outputs big_one_thread = run(x17, dy17);
  omp_set_num_threads(saved_threads);

  EXPECT_TRUE(bitwise_equal(small.y, big.y.slice(0, 3).clone()));
  EXPECT_TRUE(bitwise_equal(small.rstd, big.rstd.slice(0, 3).clone()));
  EXPECT_TRUE(bitwise_equal(small.dx, big.dx.slice(0, 3).clone()));
  EXPECT_TRUE(bitwise_equal(big.y, big_one_thread.y));
  EXPECT_TRUE(bitwise_equal(big.dx, big_one_thread.dx));
  EXPECT_TRUE(bitwise_equal(big.dw, big_one_thread.dw));
}

TEST(RmsNorm, RejectsBadArguments) {
  const Tensor x = Tensor::zeros({4, 8}, DType::F32);
  const Tensor w = Tensor::zeros({8}, DType::F32);
  Tensor y = Tensor::zeros({4, 8}, DType::F32);
  Tensor rstd = Tensor::zeros({4}, DType::F32);
  Stream& s = Stream::cpu();
  expect_error([&] { rmsnorm_forward(s, y, rstd, x, Tensor::zeros({7}, DType::F32), {}); },
               "rmsnorm_forward: w: expected shape [8] but found [7]");
  expect_error([&] { rmsnorm_forward(s, y, rstd, x, Tensor::zeros({8}, DType::F64), {}); },
               "rmsnorm_forward: w: expected dtype f32 but found f64");
  expect_error(
      [&] {
        rmsnorm_forward(s, Tensor::zeros({4, 9}, DType::F32), rstd, x, w, {});
      },
      "rmsnorm_forward: y: expected shape [4, 8] but found [4, 9]");
  expect_error([&] { rmsnorm_forward(s, y, Tensor::zeros({5}, DType::F32), x, w, {}); },
               "expected rstd with N = 4 elements");
  expect_error(
      [&] {
        rmsnorm_forward(s, y, rstd, Tensor::zeros({4, 8}, DType::I32), w, {});
      },
      "expected x in f32 or f64");
  expect_error([&] { rmsnorm_forward(s, y, rstd, x, w, {-1.0f, false}); }, "expected eps >= 0");
  expect_error(
      [&] {
        rmsnorm_backward_input(s, Tensor::zeros({4, 8}, DType::F32), Tensor::zeros({8, 4}, DType::F32), x, w, rstd, {});
      },
      "rmsnorm_backward_input: dy: expected shape [4, 8] but found [8, 4]");
  expect_error(
      [&] {
        rmsnorm_backward_weight(s, Tensor::zeros({4}, DType::F32), Tensor::zeros({4, 8}, DType::F32), x, rstd);
      },
      "rmsnorm_backward_weight: dw: expected shape [8] but found [4]");
  expect_error(
      [&] {
        rmsnorm_backward_weight(s, Tensor::zeros({8}, DType::F64), Tensor::zeros({4, 8}, DType::F32), x, rstd);
      },
      "rmsnorm_backward_weight: dw: expected dtype f32 but found f64");
}

// The whole backward in one op: on the CPU the bits of the input gradient (with its addend) and the weight gradient
// ops, dx over dy included (the weight gradient still reads the original dy).
TEST(RmsNormBackward, MatchesTheInputAndWeightOpsBitwise) {
  Rng rng(12);
  for (const bool zero_centered : {false, true}) {
    for (const bool with_addend : {false, true}) {
      for (const bool in_place : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "zero_centered " << zero_centered << ", addend " << with_addend
                                          << ", dx over dy " << in_place);
        const RmsNormParams params{1e-5f, zero_centered};
        const Tensor x = random_tensor({7, 24}, DType::F32, rng);
        const Tensor w = random_tensor({24}, DType::F32, rng);
        const Tensor dy = random_tensor({7, 24}, DType::F32, rng);
        const Tensor addend = with_addend ? random_tensor({7, 24}, DType::F32, rng) : Tensor();
        const Tensor dw0 = random_tensor({24}, DType::F32, rng);
        Tensor y = Tensor::empty({7, 24}, DType::F32), rstd = Tensor::empty({7}, DType::F32);
        rmsnorm_forward(Stream::cpu(), y, rstd, x, w, params);

        Tensor want_dx = Tensor::empty({7, 24}, DType::F32), want_dw = dw0.clone();
        if (with_addend) {
          rmsnorm_backward_input_add(Stream::cpu(), want_dx, dy, x, w, rstd, params, addend);
        } else {
          rmsnorm_backward_input(Stream::cpu(), want_dx, dy, x, w, rstd, params);
        }
        rmsnorm_backward_weight(Stream::cpu(), want_dw, dy, x, rstd);

        Tensor dy_in = dy.clone(), dw = dw0.clone();
        Tensor dx = in_place ? dy_in : Tensor::empty({7, 24}, DType::F32);
        rmsnorm_backward(Stream::cpu(), dx, dw, dy_in, x, w, rstd, params, addend);
        EXPECT_TRUE(bitwise_equal(dx, want_dx));
        EXPECT_TRUE(bitwise_equal(dw, want_dw));
      }
    }
  }
}

TEST(RmsNormBackward, RejectsBadArguments) {
  const Tensor x = Tensor::zeros({4, 8}, DType::F32), w = Tensor::zeros({8}, DType::F32);
  const Tensor dy = Tensor::zeros({4, 8}, DType::F32), rstd = Tensor::zeros({4}, DType::F32);
  Tensor dx = Tensor::zeros({4, 8}, DType::F32), dw = Tensor::zeros({8}, DType::F32);
  Stream& s = Stream::cpu();
  expect_error([&] { rmsnorm_backward(s, dx, Tensor::zeros({4}, DType::F32), dy, x, w, rstd, {}); },
               "rmsnorm_backward: dw: expected shape [8] but found [4]");
  expect_error([&] { rmsnorm_backward(s, dx, Tensor::zeros({8}, DType::F64), dy, x, w, rstd, {}); },
               "rmsnorm_backward: dw: expected dtype f32 but found f64");
  expect_error([&] { rmsnorm_backward(s, dx, dw, dy, x, w, rstd, {}, Tensor::zeros({4, 9}, DType::F32)); },
               "rmsnorm_backward: addend: expected shape [4, 8] but found [4, 9]");
  expect_error([&] { rmsnorm_backward(s, dx, dw, dy, x, w, rstd, {}, dx); }, "expected the addend");
  expect_error([&] { rmsnorm_backward(s, dx, dx.view({32}).slice(0, 8), dy, x, w, rstd, {}); },
               "expected dw");
  expect_error([&] { rmsnorm_backward(s, dx, dw, Tensor::zeros({8, 4}, DType::F32), x, w, rstd, {}); },
               "rmsnorm_backward: dy: expected shape [4, 8] but found [8, 4]");
  expect_error([&] { rmsnorm_backward(s, dx, dw, dy, x, w, Tensor::zeros({5}, DType::F32), {}); },
               "expected rstd with N = 4 elements");
}

// The fused op's outputs next to those of add_forward then rmsnorm_forward.
struct AddNormOutputs {
  Tensor sum, y, rstd;
};

AddNormOutputs run_add_rmsnorm(const Tensor& a, const Tensor& b, const Tensor& w, const RmsNormParams& params) {
  const int64_t rows = a.numel() / a.size(-1);
  AddNormOutputs o{Tensor::empty(a.shape(), a.dtype()), Tensor::empty(a.shape(), a.dtype()),
                   Tensor::empty({rows}, a.dtype())};
  add_rmsnorm_forward(Stream::cpu(), o.sum, o.y, o.rstd, a, b, w, params);
  return o;
}

AddNormOutputs run_add_then_rmsnorm(const Tensor& a, const Tensor& b, const Tensor& w, const RmsNormParams& params) {
  const int64_t rows = a.numel() / a.size(-1);
  AddNormOutputs o{Tensor::empty(a.shape(), a.dtype()), Tensor::empty(a.shape(), a.dtype()),
                   Tensor::empty({rows}, a.dtype())};
  add_forward(Stream::cpu(), o.sum, a, b);
  rmsnorm_forward(Stream::cpu(), o.y, o.rstd, o.sum, w, params);
  return o;
}

TEST(AddRmsNorm, MatchesAddThenRmsNormBitwise) {
  for (DType dtype : {DType::F32, DType::F64}) {
    for (bool zero_centered : {false, true}) {
      for (const Shape& shape : {Shape{3, 4, 32}, Shape{5, 1}, Shape{7, 200}, Shape{0, 8}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << (zero_centered ? " zero-centred" : " plain")
                                          << " shape [" << shape[0] << ", " << shape[1] << "]");
        Rng rng(11);
        const Tensor a = random_tensor(shape, dtype, rng);
        const Tensor b = random_tensor(shape, dtype, rng, 0.3);
        const Tensor w = random_tensor({shape.back()}, dtype, rng, 0.5);
        const RmsNormParams params{1e-6f, zero_centered};
        const AddNormOutputs got = run_add_rmsnorm(a, b, w, params);
        const AddNormOutputs want = run_add_then_rmsnorm(a, b, w, params);
        EXPECT_TRUE(bitwise_equal(got.sum, want.sum)) << "sum";
        EXPECT_TRUE(bitwise_equal(got.y, want.y)) << "y";
        EXPECT_TRUE(bitwise_equal(got.rstd, want.rstd)) << "rstd";
      }
    }
  }
}

TEST(AddRmsNorm, ForwardMatchesDirectComputation) {
  // Independent of the library: sum = a + b in float, then the double reference of RMSNorm on those sums.
  Rng rng(12);
  const Tensor a = random_tensor({6, 48}, DType::F32, rng);
  const Tensor b = random_tensor({6, 48}, DType::F32, rng);
  const Tensor w = random_tensor({48}, DType::F32, rng, 0.5);
  const AddNormOutputs got = run_add_rmsnorm(a, b, w, {});
  const std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>();
  std::vector<float> sum(av.size());
  for (size_t i = 0; i < av.size(); ++i) sum[i] = av[i] + bv[i];
  EXPECT_EQ(got.sum.to_vector<float>(), sum);
  std::vector<double> want_y, want_rstd;
  reference_rmsnorm(sum, w.to_vector<float>(), 48, RmsNormParams{}.eps, false, &want_y, &want_rstd);
  // f32 rounding of a 48-term sum and three products: ~1e-7 relative; 1e-6 leaves room and catches any real error.
  EXPECT_LT(relative_error(got.y.to_vector<float>(), want_y), 1e-6);
  EXPECT_LT(relative_error(got.rstd.to_vector<float>(), want_rstd), 1e-6);
}

TEST(AddRmsNorm, SumMayOverwriteEitherResidualInput) {
  Rng rng(13);
  const Tensor a = random_tensor({9, 64}, DType::F32, rng);
  const Tensor b = random_tensor({9, 64}, DType::F32, rng);
  const Tensor w = random_tensor({64}, DType::F32, rng);
  const AddNormOutputs want = run_add_then_rmsnorm(a, b, w, {});
  for (int which : {0, 1}) {
    SCOPED_TRACE(which == 0 ? "sum aliases a" : "sum aliases b");
    Tensor a_inout = a.clone(), b_inout = b.clone();
    Tensor& sum = which == 0 ? a_inout : b_inout;
    Tensor y = Tensor::empty({9, 64}, DType::F32), rstd = Tensor::empty({9}, DType::F32);
    add_rmsnorm_forward(Stream::cpu(), sum, y, rstd, a_inout, b_inout, w, {});
    EXPECT_TRUE(bitwise_equal(sum, want.sum));
    EXPECT_TRUE(bitwise_equal(y, want.y));
    EXPECT_TRUE(bitwise_equal(rstd, want.rstd));
  }
}

TEST(AddRmsNorm, RowsAreBatchInvariant) {
  Rng rng(14);
  const Tensor a = random_tensor({17, 200}, DType::F32, rng);
  const Tensor b = random_tensor({17, 200}, DType::F32, rng);
  const Tensor w = random_tensor({200}, DType::F32, rng);
  const AddNormOutputs big = run_add_rmsnorm(a, b, w, {});
  const AddNormOutputs small = run_add_rmsnorm(a.slice(0, 3).clone(), b.slice(0, 3).clone(), w, {});
  EXPECT_TRUE(bitwise_equal(small.sum, big.sum.slice(0, 3).clone()));
  EXPECT_TRUE(bitwise_equal(small.y, big.y.slice(0, 3).clone()));
  EXPECT_TRUE(bitwise_equal(small.rstd, big.rstd.slice(0, 3).clone()));
}

TEST(AddRmsNorm, RejectsBadArguments) {
  const Tensor a = Tensor::zeros({4, 8}, DType::F32);
  const Tensor b = Tensor::zeros({4, 8}, DType::F32);
  const Tensor w = Tensor::zeros({8}, DType::F32);
  Tensor sum = Tensor::zeros({4, 8}, DType::F32);
  Tensor y = Tensor::zeros({4, 8}, DType::F32);
  Tensor rstd = Tensor::zeros({4}, DType::F32);
  Stream& s = Stream::cpu();
  expect_error(
      [&] {
        add_rmsnorm_forward(s, sum, y, rstd, a, Tensor::zeros({4, 9}, DType::F32), w, {});
      },
      "add_rmsnorm_forward: b: expected shape [4, 8] but found [4, 9]");
  expect_error(
      [&] {
        add_rmsnorm_forward(s, Tensor::zeros({4, 8}, DType::F64), y, rstd, a, b, w, {});
      },
      "add_rmsnorm_forward: sum: expected dtype f32 but found f64");
  expect_error(
      [&] {
        add_rmsnorm_forward(s, sum, Tensor::zeros({8, 4}, DType::F32), rstd, a, b, w, {});
      },
      "add_rmsnorm_forward: y: expected shape [4, 8] but found [8, 4]");
  expect_error([&] { add_rmsnorm_forward(s, sum, y, rstd, a, b, Tensor::zeros({7}, DType::F32), {}); },
               "add_rmsnorm_forward: w: expected shape [8] but found [7]");
  expect_error([&] { add_rmsnorm_forward(s, sum, y, Tensor::zeros({3}, DType::F32), a, b, w, {}); },
               "expected rstd with N = 4 elements");
  expect_error([&] { add_rmsnorm_forward(s, sum, sum, rstd, a, b, w, {}); },
               "add_rmsnorm_forward: expected y and sum in separate memory");
  expect_error(
      [&] {
        add_rmsnorm_forward(s, sum, y, rstd, Tensor::zeros({4, 8}, DType::I32), b, w, {});
      },
      "add_rmsnorm_forward: expected a in f32 or f64");
  expect_error([&] { add_rmsnorm_forward(s, sum, y, rstd, a, b, w, {-1.0f, false}); }, "expected eps >= 0");
}

}  // namespace
}  // namespace moetrain::ops
