// Tests for ops/gemm: every transpose combination against an ascending-k dot product written here (bitwise),
// gradients of gemm and of the linear layer against finite differences, accumulation of linear_backward_weight,
// batch and thread-count invariance, and argument checks.
#include "ops/gemm.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "core/rng.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::random_tensor;

constexpr Transpose kNo = Transpose::No;
constexpr Transpose kYes = Transpose::Yes;

void expect_error(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected a moetrain::Error mentioning \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// A stored [rows, cols] matrix, or its transpose: the stored form of an operand whose op() is [rows, cols].
Shape stored_shape(int64_t rows, int64_t cols, Transpose t) { return t == kNo ? Shape{rows, cols} : Shape{cols, rows}; }

std::string combo_name(Transpose ta, Transpose tb) {
  return std::string(ta == kNo ? "a" : "a^T") + " * " + (tb == kNo ? "b" : "b^T");
}

// out = alpha * op(a) op(b) + beta * out as the definition says: one float accumulator per element, k ascending.
template <typename T>
void direct_gemm(std::vector<T>& out, const std::vector<T>& a, Transpose ta, const std::vector<T>& b, Transpose tb,
                 int64_t m, int64_t n, int64_t k, T alpha, T beta) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      T acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const T av = ta == kNo ? a[i * k + p] : a[p * m + i];
        const T bv = tb == kNo ? b[p * n + j] : b[j * k + p];
        acc += av * bv;
      }
      T& o = out[i * n + j];
      o = beta == T(0) ? alpha * acc : alpha * acc + beta * o;
    }
  }
}

TEST(Gemm, EveryTransposeIsAnAscendingDotProduct) {
  // Sizes cross the kernel's row chunk (64), column panel (64) and register tile edges.
  const int64_t m = 70, n = 131, k = 37;
  for (Transpose ta : {kNo, kYes}) {
    for (Transpose tb : {kNo, kYes}) {
      SCOPED_TRACE(combo_name(ta, tb));
      Rng rng(10);
      const Tensor a = random_tensor(stored_shape(m, k, ta), DType::F32, rng);
      const Tensor b = random_tensor(stored_shape(k, n, tb), DType::F32, rng);
      const Tensor start = random_tensor({m, n}, DType::F32, rng);

      Tensor out = start.clone();
      gemm(Stream::cpu(), out, a, ta, b, tb, 0.5, 2.0);
      std::vector<float> want = start.to_vector<float>();
      direct_gemm<float>(want, a.to_vector<float>(), ta, b.to_vector<float>(), tb, m, n, k, 0.5f, 2.0f);
      EXPECT_EQ(out.to_vector<float>(), want);

      // beta = 0 must not read out: NaN garbage there must not leak into the result.
      Tensor garbage = Tensor::empty({m, n}, DType::F32);
      std::vector<float> nan(static_cast<size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
      std::memcpy(garbage.raw_data(), nan.data(), garbage.nbytes());
      gemm(Stream::cpu(), garbage, a, ta, b, tb);
      std::vector<float> want_plain(static_cast<size_t>(m * n), 0.0f);
      direct_gemm<float>(want_plain, a.to_vector<float>(), ta, b.to_vector<float>(), tb, m, n, k, 1.0f, 0.0f);
      EXPECT_EQ(garbage.to_vector<float>(), want_plain);
    }
  }
}

TEST(Gemm, MatchesDoublePrecisionProduct) {
  const int64_t m = 9, n = 11, k = 300;
  Rng rng(11);
  const Tensor a = random_tensor({m, k}, DType::F32, rng);
  const Tensor b = random_tensor({n, k}, DType::F32, rng);
  Tensor out = Tensor::empty({m, n}, DType::F32);
  gemm(Stream::cpu(), out, a, kNo, b, kYes);
  std::vector<double> want(static_cast<size_t>(m * n), 0.0);
  const auto af = a.to_vector<float>(), bf = b.to_vector<float>();
  direct_gemm<double>(want, std::vector<double>(af.begin(), af.end()), kNo, std::vector<double>(bf.begin(), bf.end()),
                      kYes, m, n, k, 1.0, 0.0);
  Tensor want_t = Tensor::from_vector(want, {m, n});
  EXPECT_LT(testing::relative_error(out.to(DType::F64), want_t), 1e-6);
}

TEST(Gemm, EmptyInnerDimensionScalesOut) {
  const Tensor a = Tensor::zeros({3, 0}, DType::F32);
  const Tensor b = Tensor::zeros({0, 2}, DType::F32);
  Tensor out = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  gemm(Stream::cpu(), out, a, kNo, b, kNo, 1.0, 0.5);
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f, 2.5f, 3.0f}));
}

TEST(Gemm, GradientsMatchFiniteDifferences) {
  // loss = <alpha * op(a) op(b) + beta * c, g>; the gradients are themselves gemms:
  // d op(a) = alpha g op(b)^T, d op(b) = alpha op(a)^T g, dc = beta g.
  const int64_t m = 4, n = 5, k = 3;
  const double alpha = 0.75, beta = -1.5;
  for (Transpose ta : {kNo, kYes}) {
    for (Transpose tb : {kNo, kYes}) {
      SCOPED_TRACE(combo_name(ta, tb));
      Rng rng(12);
      Tensor a = random_tensor(stored_shape(m, k, ta), DType::F64, rng);
      Tensor b = random_tensor(stored_shape(k, n, tb), DType::F64, rng);
      Tensor c = random_tensor({m, n}, DType::F64, rng);
      const Tensor g = random_tensor({m, n}, DType::F64, rng);
      Tensor out = Tensor::empty({m, n}, DType::F64);
      auto loss = [&] {
        out.copy_from(c);
        gemm(Stream::cpu(), out, a, ta, b, tb, alpha, beta);
        return testing::dot(out, g);
      };

      Tensor da = Tensor::empty(a.shape(), DType::F64);
      Tensor db = Tensor::empty(b.shape(), DType::F64);
      if (ta == kNo) {
        gemm(Stream::cpu(), da, g, kNo, b, tb == kNo ? kYes : kNo, alpha);  // [M, K] = g op(b)^T
      } else {
        gemm(Stream::cpu(), da, b, tb, g, kYes, alpha);  // [K, M] = op(b) g^T
      }
      if (tb == kNo) {
        gemm(Stream::cpu(), db, a, ta == kNo ? kYes : kNo, g, kNo, alpha);  // [K, N] = op(a)^T g
      } else {
        gemm(Stream::cpu(), db, g, kYes, a, ta, alpha);  // [N, K] = g^T op(a)
      }
      Tensor dc = g.clone();
      for (double& v : std::span(dc.data<double>(), static_cast<size_t>(dc.numel()))) v *= beta;
      testing::expect_gradients_match(loss, {{"a", a, da}, {"b", b, db}, {"c", c, dc}});
    }
  }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t m = 6, k = 5, n = 4;
  Rng rng(13);
  Tensor x = random_tensor({m, k}, DType::F64, rng);
  Tensor w = random_tensor({n, k}, DType::F64, rng);
  const Tensor g = random_tensor({m, n}, DType::F64, rng);
  Tensor y = Tensor::empty({m, n}, DType::F64);
  auto loss = [&] {
    linear_forward(Stream::cpu(), y, x, w);
    return testing::dot(y, g);
  };
  Tensor dx = Tensor::empty({m, k}, DType::F64);
  Tensor dw = Tensor::zeros({n, k}, DType::F64);
  linear_backward_input(Stream::cpu(), dx, g, w);
  linear_backward_weight(Stream::cpu(), dw, g, x);
  testing::expect_gradients_match(loss, {{"x", x, dx}, {"w", w, dw}});
}

TEST(Linear, ForwardIsXTimesWTransposed) {
  const Tensor x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor w = Tensor::from_vector<float>({1, 0, -1, 2, 1, 0}, {2, 3});
  Tensor y = Tensor::empty({2, 2}, DType::F32);
  linear_forward(Stream::cpu(), y, x, w);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{-2, 4, -2, 13}));
}

TEST(Linear, BackwardWeightAccumulatesMicroBatches) {
  const int64_t k = 7, n = 5;
  Rng rng(14);
  const Tensor x1 = random_tensor({4, k}, DType::F64, rng), dy1 = random_tensor({4, n}, DType::F64, rng);
  const Tensor x2 = random_tensor({9, k}, DType::F64, rng), dy2 = random_tensor({9, n}, DType::F64, rng);
  const Tensor start = random_tensor({n, k}, DType::F64, rng);
  Tensor dw = start.clone();
  linear_backward_weight(Stream::cpu(), dw, dy1, x1);
  linear_backward_weight(Stream::cpu(), dw, dy2, x2);

  std::vector<double> want = start.to_vector<double>();
  for (const auto& [dy, x] : {std::pair{dy1, x1}, std::pair{dy2, x2}}) {
    const auto dyv = dy.to_vector<double>(), xv = x.to_vector<double>();
    for (int64_t o = 0; o < n; ++o) {
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t t = 0; t < x.size(0); ++t) want[o * k + i] += dyv[t * n + o] * xv[t * k + i];
      }
    }
  }
  EXPECT_LT(testing::relative_error(dw, Tensor::from_vector(want, {n, k})), 1e-12);
}

// The first write of a step overwrites: the bytes of accumulating onto zeros, whatever dw held (NaN here), and an
// empty micro-batch (M = 0) leaves zeros.
TEST(Linear, BackwardWeightOverwriteGivesTheBytesOfAccumulatingOntoZeros) {
  const int64_t k = 7, n = 5;
  Rng rng(15);
  for (const int64_t m : {int64_t{9}, int64_t{0}}) {
    SCOPED_TRACE(m);
    Tensor dy = random_tensor({m, n}, DType::F32, rng), x = random_tensor({m, k}, DType::F32, rng);
    for (int64_t t = 0; t < m; ++t) {  // dw[0, 0]: every product -0 (dy 0 against negative x), onto zeros +0
      dy.data<float>()[t * n] = 0.0f;
      x.data<float>()[t * k] = -1.0f;
    }
    Tensor onto_zeros = Tensor::zeros({n, k}, DType::F32);
    linear_backward_weight(Stream::cpu(), onto_zeros, dy, x);
    Tensor dw = Tensor::from_vector(std::vector<float>(n * k, std::numeric_limits<float>::quiet_NaN()), {n, k});
    linear_backward_weight(Stream::cpu(), dw, dy, x, GradientWrite::Overwrite);
    EXPECT_EQ(std::memcmp(dw.data<float>(), onto_zeros.data<float>(), sizeof(float) * n * k), 0);
  }
}

TEST(Gemm, RowsAreBatchInvariantAndThreadCountInvariant) {
  const int64_t k = 150, n = 140;
  for (Transpose ta : {kNo, kYes}) {
    for (Transpose tb : {kNo, kYes}) {
      SCOPED_TRACE(combo_name(ta, tb));
      Rng rng(15);
      // op(a) rows 0..16; the 3-row problem holds the first 3 of them.
      const Tensor a_rows = random_tensor({17, k}, DType::F32, rng);
      auto stored = [&](int64_t rows) {
        Tensor t = Tensor::empty(stored_shape(rows, k, ta), DType::F32);
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t p = 0; p < k; ++p) {
            const float v = a_rows.data<float>()[i * k + p];
            (ta == kNo ? t.data<float>()[i * k + p] : t.data<float>()[p * rows + i]) = v;
          }
        }
        return t;
      };
      const Tensor a17 = stored(17), a3 = stored(3);
      const Tensor b = random_tensor(stored_shape(k, n, tb), DType::F32, rng);

      const int saved_threads = omp_get_max_threads();
      omp_set_num_threads(2);
      Tensor out17 = Tensor::empty({17, n}, DType::F32), out3 = Tensor::empty({3, n}, DType::F32);
      gemm(Stream::cpu(), out17, a17, ta, b, tb);
      gemm(Stream::cpu(), out3, a3, ta, b, tb);
      omp_set_num_threads(1);
      Tensor out17_one_thread = Tensor::empty({17, n}, DType::F32);
      gemm(Stream::cpu(), out17_one_thread, a17, ta, b, tb);
      omp_set_num_threads(saved_threads);

      EXPECT_TRUE(bitwise_equal(out3, out17.slice(0, 3).clone()));
      EXPECT_TRUE(bitwise_equal(out17, out17_one_thread));
    }
  }
}

TEST(Gemm, ThreadCountDoesNotChangeLargeProducts) {
  // Many tasks (row chunks x column panels), so two threads really split the work.
  Rng rng(16);
  const Tensor a = random_tensor({150, 90}, DType::F32, rng);
  const Tensor b = random_tensor({200, 90}, DType::F32, rng);
  const int saved_threads = omp_get_max_threads();
  Tensor two = Tensor::empty({150, 200}, DType::F32), one = Tensor::empty({150, 200}, DType::F32);
  omp_set_num_threads(2);
  gemm(Stream::cpu(), two, a, kNo, b, kYes);
  omp_set_num_threads(1);
  gemm(Stream::cpu(), one, a, kNo, b, kYes);
  omp_set_num_threads(saved_threads);
  EXPECT_TRUE(bitwise_equal(one, two));
}

TEST(Gemm, RejectsBadArguments) {
  const Tensor a = Tensor::zeros({3, 4}, DType::F32);
  const Tensor b = Tensor::zeros({4, 5}, DType::F32);
  Tensor out = Tensor::zeros({3, 5}, DType::F32);
  Stream& s = Stream::cpu();
  expect_error([&] { gemm(s, out, a, kNo, b, kYes); }, "gemm: inner dimensions differ");
  expect_error(
      [&] {
        gemm(s, Tensor::zeros({5, 3}, DType::F32), a, kNo, b, kNo);
      },
      "expected shape [3, 5] but found [5, 3]");
  expect_error(
      [&] {
        gemm(s, out, a, kNo, Tensor::zeros({4, 5}, DType::F64), kNo);
      },
      "gemm: b: expected dtype f32 but found f64");
  expect_error(
      [&] {
        gemm(s, out, Tensor::zeros({3, 4, 1}, DType::F32), kNo, b, kNo);
      },
      "expected a to be a 2-D matrix");
  expect_error([&] { gemm(s, out, Tensor::zeros({3, 4}, DType::I32), kNo, b, kNo); }, "expected a in f32 or f64");
  Tensor square = Tensor::zeros({4, 4}, DType::F32);
  expect_error([&] { gemm(s, square, square, kNo, square, kNo); }, "must not share memory");
}

TEST(Linear, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor x = Tensor::zeros({3, 4}, DType::F32);
  const Tensor w = Tensor::zeros({5, 4}, DType::F32);
  expect_error(
      [&] {
        linear_forward(s, Tensor::zeros({3, 5}, DType::F32), x, Tensor::zeros({5, 6}, DType::F32));
      },
      "linear_forward: x [M, K] is [3, 4] but w [N, K] is [5, 6]: K differs");
  expect_error(
      [&] {
        linear_forward(s, Tensor::zeros({3, 4}, DType::F32), x, w);
      },
      "linear_forward: y [M, N]: expected shape [3, 5] but found [3, 4]");
  expect_error(
      [&] {
        linear_forward(s, Tensor::zeros({3, 5}, DType::F32), x, Tensor::zeros({5, 4}, DType::F64));
      },
      "linear_forward: w: expected dtype f32 but found f64");
  expect_error(
      [&] {
        linear_backward_input(s, Tensor::zeros({3, 4}, DType::F32), Tensor::zeros({3, 6}, DType::F32), w);
      },
      "linear_backward_input: dy [M, N] is [3, 6] but w [N, K] is [5, 4]: N differs");
  expect_error(
      [&] {
        linear_backward_weight(s, Tensor::zeros({5, 4}, DType::F32), Tensor::zeros({2, 5}, DType::F32), x);
      },
      "linear_backward_weight: dy [M, N] is [2, 5] but x [M, K] is [3, 4]: M differs");
  expect_error(
      [&] {
        linear_backward_weight(s, Tensor::zeros({4, 5}, DType::F32), Tensor::zeros({3, 5}, DType::F32), x);
      },
      "linear_backward_weight: dw [N, K]: expected shape [5, 4] but found [4, 5]");
}

}  // namespace
}  // namespace moetrain::ops
