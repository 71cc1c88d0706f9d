// Tests for the CUDA gemm (ops/cuda/gemm.*, cuBLASLt) against the CPU reference (the same public op on CPU
// tensors): every transpose combination, alpha / beta, odd and degenerate shapes, bf16 operands with f32 and bf16
// outputs, the linear ops incl. the mixed-precision weight gradient, empty dimensions, unaligned operands,
// determinism, and argument checks. Each comparison prints its relative error ||gpu - cpu|| / ||cpu||.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/gemm.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::rounded_to_bf16;

constexpr Transpose kNo = Transpose::No;
constexpr Transpose kYes = Transpose::Yes;

// Unit roundoff of f32 and bf16.
constexpr double kF32Unit = 0x1p-24;

// Threshold for two f32 results of a length-K reduction computed in different orders (the CPU adds k in ascending
// order, cuBLASLt in blocks): an ascending f32 sum of K random terms has a relative error of about
// u * sqrt(K / 6), so two such results differ by ~u * sqrt(K); 4x that, and never below 1e-6 (the alpha / beta
// update adds a few roundings of its own), leaves margin without hiding a wrong term (which costs ~1 / sqrt(K)).
double f32_tolerance(int64_t k) { return std::max(1e-6, 4.0 * kF32Unit * std::sqrt(static_cast<double>(k))); }
// An output stored in bf16 against the CPU's f32 result on the same (bf16-valued) inputs: the final rounding is a
// relative error of at most 2^-9 per element (rms ~2^-9 / sqrt(3)); 2^-8 is twice that bound.
constexpr double kBf16OutputTolerance = 0x1p-8;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

Shape stored_shape(int64_t rows, int64_t cols, Transpose t) { return t == kNo ? Shape{rows, cols} : Shape{cols, rows}; }

std::string case_name(int64_t m, int64_t n, int64_t k, Transpose ta, Transpose tb, double alpha, double beta) {
  return fmt::format("M={} N={} K={} {} * {} alpha={} beta={}", m, n, k, ta == kNo ? "a" : "a^T",
                     tb == kNo ? "b" : "b^T", alpha, beta);
}

// Checks ||gpu - cpu|| / ||cpu|| <= tolerance and prints the measured error (the lead reads these on the H200).
void expect_close(const Tensor& gpu_result, const Tensor& cpu_result, double tolerance, const std::string& what) {
  const double err = testing::relative_error(gpu_result, cpu_result);
  std::printf("    %-70s relative error %.3e (threshold %.1e)\n", what.c_str(), err, tolerance);
  EXPECT_LE(err, tolerance) << what << ": ||gpu - cpu|| / ||cpu|| = " << err
                            << ", max |gpu - cpu| = " << testing::max_abs_diff(gpu_result, cpu_result);
}

void expect_error(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected a moetrain::Error mentioning \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

struct GemmShape {
  int64_t m, n, k;
};

// M = 1 (a single token), odd sizes that fill no tile, a wide and a deep product, and K = 1.
const std::vector<GemmShape> kShapes{{1, 1, 1}, {1, 96, 256}, {37, 53, 29}, {64, 1, 300}, {5, 7, 1}, {128, 96, 1024}};

struct Scaling {
  double alpha, beta;
};
const std::vector<Scaling> kScalings{{1.0, 0.0}, {0.5, -1.5}};

// out_dtype on the GPU; operands f32 or bf16. The CPU reference runs in f32 on the operands' values (bf16-rounded
// where the GPU sees bf16) and on out's starting values as the GPU holds them.
void check_against_cpu(DType operand_dtype, DType out_dtype, uint64_t seed) {
  for (const GemmShape& s : kShapes) {
    for (Transpose ta : {kNo, kYes}) {
      for (Transpose tb : {kNo, kYes}) {
        for (const Scaling& sc : kScalings) {
          const std::string name = case_name(s.m, s.n, s.k, ta, tb, sc.alpha, sc.beta);
          SCOPED_TRACE(name);
          Rng rng(seed++);
          Tensor a = random_tensor(stored_shape(s.m, s.k, ta), DType::F32, rng);
          Tensor b = random_tensor(stored_shape(s.k, s.n, tb), DType::F32, rng);
          Tensor c = random_tensor({s.m, s.n}, DType::F32, rng);
          if (operand_dtype == DType::BF16) {
            a = rounded_to_bf16(a);
            b = rounded_to_bf16(b);
          }
          if (out_dtype == DType::BF16) c = rounded_to_bf16(c);

          Tensor want = c.clone();
          gemm(Stream::cpu(), want, a, ta, b, tb, sc.alpha, sc.beta);

          Tensor out = on_gpu(c.to(out_dtype));
          gemm(gpu(), out, on_gpu(a.to(operand_dtype)), ta, on_gpu(b.to(operand_dtype)), tb, sc.alpha, sc.beta);
          const double tolerance = out_dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(s.k);
          expect_close(host_f32(out), want, tolerance, name);
        }
      }
    }
  }
}

TEST(CudaGemm, F32MatchesCpuForEveryTransposeAndScaling) {
  MT_REQUIRE_GPU();
  check_against_cpu(DType::F32, DType::F32, 100);
}

// Products of two bf16 values are exact in f32, so with f32 accumulation and an f32 output only the summation
// order differs from the CPU: the f32 threshold applies.
TEST(CudaGemm, Bf16OperandsWithF32OutputMatchCpuOnRoundedInputs) {
  MT_REQUIRE_GPU();
  check_against_cpu(DType::BF16, DType::F32, 200);
}

TEST(CudaGemm, Bf16OutputIsTheRoundedF32Product) {
  MT_REQUIRE_GPU();
  check_against_cpu(DType::BF16, DType::BF16, 300);
}

TEST(CudaGemm, BetaZeroDoesNotReadOut) {
  MT_REQUIRE_GPU();
  Rng rng(1);
  const int64_t m = 37, n = 53, k = 29;
  const Tensor a = random_tensor({m, k}, DType::F32, rng);
  const Tensor b = random_tensor({k, n}, DType::F32, rng);
  Tensor want = Tensor::empty({m, n}, DType::F32);
  gemm(Stream::cpu(), want, a, kNo, b, kNo, 2.0, 0.0);
  Tensor garbage = Tensor::empty({m, n}, DType::F32);
  std::vector<float> nan(static_cast<size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
  std::memcpy(garbage.raw_data(), nan.data(), garbage.nbytes());
  Tensor out = on_gpu(garbage);
  gemm(gpu(), out, on_gpu(a), kNo, on_gpu(b), kNo, 2.0, 0.0);
  expect_close(host_f32(out), want, f32_tolerance(k), "NaN in out, beta = 0");
}

TEST(CudaGemm, EmptyDimensionsNeedNoCublas) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    // K == 0: out = beta * out (beta = 0.5 scales, beta = 0 writes zeros over NaN).
    const Tensor start = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
    Tensor out = on_gpu(start.to(dtype));
    gemm(gpu(), out, on_gpu(Tensor::zeros({3, 0}, dtype)), kNo, on_gpu(Tensor::zeros({0, 2}, dtype)), kNo, 1.0, 0.5);
    EXPECT_EQ(host_f32(out).to_vector<float>(), (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f, 2.5f, 3.0f}));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    out = on_gpu(Tensor::from_vector<float>({nan, nan, nan, nan, nan, nan}, {3, 2}).to(dtype));
    gemm(gpu(), out, on_gpu(Tensor::zeros({0, 3}, dtype)), kYes, on_gpu(Tensor::zeros({2, 0}, dtype)), kYes);
    EXPECT_EQ(host_f32(out).to_vector<float>(), std::vector<float>(6, 0.0f));
    // M == 0 and N == 0: nothing to compute, and nothing fails.
    Tensor no_rows = on_gpu(Tensor::zeros({0, 4}, dtype));
    gemm(gpu(), no_rows, on_gpu(Tensor::zeros({0, 5}, dtype)), kNo, on_gpu(Tensor::zeros({5, 4}, dtype)), kNo);
    Tensor no_cols = on_gpu(Tensor::zeros({4, 0}, dtype));
    gemm(gpu(), no_cols, on_gpu(Tensor::zeros({4, 5}, dtype)), kNo, on_gpu(Tensor::zeros({5, 0}, dtype)), kNo);
    EXPECT_EQ(no_rows.to(Device::cpu()).numel(), 0);
    EXPECT_EQ(no_cols.to(Device::cpu()).numel(), 0);
  }
}

// Row slices start at any element, so operand and output pointers can be 2-byte aligned (bf16) or 4-byte (f32):
// the plan key carries the alignment and cuBLASLt must pick an algorithm that copes.
TEST(CudaGemm, HandlesOperandsAtUnalignedOffsets) {
  MT_REQUIRE_GPU();
  const int64_t m = 37, n = 53, k = 29;
  for (DType dtype : {DType::F32, DType::BF16}) {
    Rng rng(2);
    const Tensor a_big = rounded_to_bf16(random_tensor({m + 1, k}, DType::F32, rng));
    const Tensor b_big = rounded_to_bf16(random_tensor({n + 1, k}, DType::F32, rng));
    const Tensor a = a_big.slice(1, m + 1).clone();
    const Tensor b = b_big.slice(1, n + 1).clone();
    Tensor want = Tensor::empty({m, n}, DType::F32);
    gemm(Stream::cpu(), want, a, kNo, b, kYes);

    const Tensor a_gpu = on_gpu(a_big.to(dtype)).slice(1, m + 1);
    const Tensor b_gpu = on_gpu(b_big.to(dtype)).slice(1, n + 1);
    Tensor out_big = on_gpu(Tensor::zeros({m + 1, n}, dtype));
    Tensor out = out_big.slice(1, m + 1);
    gemm(gpu(), out, a_gpu, kNo, b_gpu, kYes);
    expect_close(host_f32(out.clone()), want, dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(k),
                 fmt::format("row-sliced {} operands and output", dtype_name(dtype)));
  }
}

TEST(CudaLinear, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  const int64_t m = 37, n = 53, k = 300;
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Rng rng(3);
    const Tensor x = rounded_to_bf16(random_tensor({m, k}, DType::F32, rng));
    const Tensor w = rounded_to_bf16(random_tensor({n, k}, DType::F32, rng));
    const Tensor dy = rounded_to_bf16(random_tensor({m, n}, DType::F32, rng));
    const double out_tolerance = dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(k);

    Tensor y = Tensor::empty({m, n}, DType::F32);
    linear_forward(Stream::cpu(), y, x, w);
    Tensor y_gpu = on_gpu(Tensor::zeros({m, n}, dtype));
    linear_forward(gpu(), y_gpu, on_gpu(x.to(dtype)), on_gpu(w.to(dtype)));
    expect_close(host_f32(y_gpu), y, out_tolerance, fmt::format("linear_forward {}", dtype_name(dtype)));

    Tensor dx = Tensor::empty({m, k}, DType::F32);
    linear_backward_input(Stream::cpu(), dx, dy, w);
    Tensor dx_gpu = on_gpu(Tensor::zeros({m, k}, dtype));
    linear_backward_input(gpu(), dx_gpu, on_gpu(dy.to(dtype)), on_gpu(w.to(dtype)));
    expect_close(host_f32(dx_gpu), dx, dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(n),
                 fmt::format("linear_backward_input {}", dtype_name(dtype)));

    // The weight gradient accumulates in f32 whatever the activations are (the mixed path for bf16).
    const Tensor dw_start = random_tensor({n, k}, DType::F32, rng);
    Tensor dw = dw_start.clone();
    linear_backward_weight(Stream::cpu(), dw, dy, x);
    Tensor dw_gpu = on_gpu(dw_start);
    linear_backward_weight(gpu(), dw_gpu, on_gpu(dy.to(dtype)), on_gpu(x.to(dtype)));
    expect_close(host_f32(dw_gpu), dw, f32_tolerance(m),
                 fmt::format("linear_backward_weight f32 += {}^T {}", dtype_name(dtype), dtype_name(dtype)));
  }
}

TEST(CudaGemm, MixedWeightGradientAccumulatesMicroBatches) {
  MT_REQUIRE_GPU();
  // dw f32 += dy^T x over two micro-batches of bf16 activations equals one pass over both (up to summation order).
  const int64_t m = 96, n = 64, k = 48;
  Rng rng(4);
  const Tensor dy = rounded_to_bf16(random_tensor({2 * m, n}, DType::F32, rng));
  const Tensor x = rounded_to_bf16(random_tensor({2 * m, k}, DType::F32, rng));
  Tensor want = Tensor::zeros({n, k}, DType::F32);
  gemm(Stream::cpu(), want, dy, kYes, x, kNo, 1.0, 1.0);
  Tensor dw = on_gpu(Tensor::zeros({n, k}, DType::F32));
  const Tensor dy_gpu = on_gpu(dy.to(DType::BF16)), x_gpu = on_gpu(x.to(DType::BF16));
  gemm(gpu(), dw, dy_gpu.slice(0, m), kYes, x_gpu.slice(0, m), kNo, 1.0, 1.0);
  gemm(gpu(), dw, dy_gpu.slice(m, 2 * m), kYes, x_gpu.slice(m, 2 * m), kNo, 1.0, 1.0);
  expect_close(host_f32(dw), want, f32_tolerance(2 * m), "two bf16 micro-batches into one f32 gradient");
}

// A weight gradient's first write of a step (beta = 0, dw never read: NaN here) gives the bytes of accumulating onto
// zeros, for bf16 and f32 operands, at small and workload-like shapes (long K = M sums); M = 0 leaves zeros. Column 0
// of dw sums only -0 products, which onto zeros give +0: the overwrite must too.
TEST(CudaLinear, BackwardWeightOverwriteGivesTheBytesOfAccumulatingOntoZeros) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t m, n, k;
  };
  Rng rng(5);
  for (const Case& c : {Case{96, 64, 48}, Case{8192, 256, 512}, Case{40, 2048, 768}, Case{0, 32, 16}}) {
    for (DType dtype : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(::testing::Message() << c.m << " x " << c.n << " x " << c.k << " " << dtype_name(dtype));
      Tensor dy_host = random_tensor({c.m, c.n}, DType::F32, rng), x_host = random_tensor({c.m, c.k}, DType::F32, rng);
      for (int64_t t = 0; t < c.m; ++t) {  // dw[0, 0]: every product -0 (dy 0 against negative x), onto zeros +0
        dy_host.data<float>()[t * c.n] = 0.0f;
        x_host.data<float>()[t * c.k] = -1.0f;
      }
      const Tensor dy = on_gpu(dy_host.to(dtype)), x = on_gpu(x_host.to(dtype));
      Tensor onto_zeros = on_gpu(Tensor::zeros({c.n, c.k}, DType::F32));
      linear_backward_weight(gpu(), onto_zeros, dy, x);
      const std::vector<float> stale(static_cast<size_t>(c.n * c.k), std::numeric_limits<float>::quiet_NaN());
      Tensor dw = on_gpu(Tensor::from_vector(stale, {c.n, c.k}));
      linear_backward_weight(gpu(), dw, dy, x, GradientWrite::Overwrite);
      const Tensor got = host_f32(dw), want = host_f32(onto_zeros);
      EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), sizeof(float) * c.n * c.k), 0);
    }
  }
}

TEST(CudaGemm, RepeatedCallsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (const GemmShape& s : kShapes) {
      SCOPED_TRACE(fmt::format("{} M={} N={} K={}", dtype_name(dtype), s.m, s.n, s.k));
      Rng rng(5);
      const Tensor a = on_gpu(random_tensor({s.k, s.m}, DType::F32, rng).to(dtype));
      const Tensor b = on_gpu(random_tensor({s.k, s.n}, DType::F32, rng).to(dtype));
      const Tensor c = random_tensor({s.m, s.n}, DType::F32, rng);
      Tensor first = on_gpu(c);
      gemm(gpu(), first, a, kYes, b, kNo, 1.0, 1.0);
      // Another problem in between: the cached plan of the first must come back unchanged.
      Tensor other = on_gpu(Tensor::zeros({s.n, s.m}, DType::F32));
      gemm(gpu(), other, b, kYes, a, kNo);
      Tensor second = on_gpu(c);
      gemm(gpu(), second, a, kYes, b, kNo, 1.0, 1.0);
      EXPECT_TRUE(bitwise_equal(first.to(Device::cpu()), second.to(Device::cpu())));
    }
  }
}

TEST(CudaGemm, RejectsUnsupportedDtypesAndMixedDevices) {
  MT_REQUIRE_GPU();
  Stream& s = gpu();
  const Tensor a = on_gpu(Tensor::zeros({3, 4}, DType::F32));
  const Tensor b = on_gpu(Tensor::zeros({4, 5}, DType::F32));
  Tensor out = on_gpu(Tensor::zeros({3, 5}, DType::F32));
  expect_error(
      [&] {
        gemm(s, out, on_gpu(Tensor::zeros({3, 4}, DType::F64)), kNo, b, kNo);
      },
      "gemm: expected a in f32 or bf16 on CUDA but found f64[3, 4] on cuda:0");
  expect_error(
      [&] {
        gemm(s, out, a, kNo, on_gpu(Tensor::zeros({4, 5}, DType::BF16)), kNo);
      },
      "gemm: b: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        gemm(s, on_gpu(Tensor::zeros({3, 5}, DType::BF16)), a, kNo, b, kNo);
      },
      "gemm: out: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        gemm(s, out, Tensor::zeros({3, 4}, DType::F32), kNo, b, kNo);
      },
      "gemm: a is on the CPU but the stream runs on cuda:0");
  expect_error([&] { gemm(Stream::cpu(), out, a, kNo, b, kNo); }, "gemm: out is on cuda:0 but the stream runs on cpu");
  expect_error([&] { gemm(s, out, a, kNo, b, kYes); }, "gemm: inner dimensions differ");
  expect_error(
      [&] {
        linear_backward_weight(s, on_gpu(Tensor::zeros({5, 4}, DType::BF16)), on_gpu(Tensor::zeros({3, 5}, DType::F32)),
                               on_gpu(Tensor::zeros({3, 4}, DType::F32)));
      },
      "linear_backward_weight: dw: expected dtype f32 but found bf16");
}

}  // namespace
}  // namespace moetrain::ops
