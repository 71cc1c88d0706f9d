// Tests for the CUDA RMSNorm kernels (ops/cuda/norm.*) through the public ops: forward, input and weight gradients
// against the CPU reference (plain and zero-centred; f32 and bf16 activations), dx aliasing dy, batch invariance,
// determinism and argument checks; the whole backward in one op against the separate ops (dx bitwise, dw within its
// summation bound); the fused residual add + RMSNorm against the two CUDA ops (bitwise) and the CPU,
// in place, batch invariance, determinism and argument checks. Run on a GPU; skipped elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/norm.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

#if MOETRAIN_HAS_CUDA
#include "ops/cuda/norm.h"
#endif

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;
using testing::same_bytes;

// f32 against the CPU: every element rounds the same f32 operations on both sides (no fused multiply-adds); only the
// sums of D (or N) terms run in different orders, the CPU sequentially, the GPU in lane-strided partials and a
// butterfly (or in row chunks), and differ by ~sqrt(length) ulp (6e-8 each) in the worst rows: 1e-6 holds for sums
// up to 256 terms and 1e-5 up to ~16k terms.
double f32_tolerance(int64_t reduced) { return reduced <= 256 ? 1e-6 : 1e-5; }
// bf16 outputs are the f32 result rounded to 8 significant bits: up to 2^-9 = 2e-3 relative per element.
constexpr double kBf16Tolerance = 1e-2;

// q/k-norm heads [T, nh, hd], a hidden row of 4096, D = 1, a D that is not a multiple of 32, many rows.
const std::vector<Shape> kShapes = {{3, 4, 32}, {5, 4096}, {7, 1}, {2, 33}, {1000, 128}, {300, 1537}};

struct Outputs {
  Tensor y, rstd, dx, dw;
};

// Runs the three ops on `device` from the host tensors (x, dy in one dtype, w f32) and returns the outputs there.
// The backward ops take `backward_rstd` (host f32) when given, else the forward's rstd.
Outputs run_all(Stream& stream, Device device, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dw0,
                const ops::RmsNormParams& params, const Tensor& backward_rstd = Tensor()) {
  const int64_t dim = x.size(-1);
  const int64_t rows = x.numel() / dim;
  Outputs out;
  const Tensor x_in = x.to(device), w_in = w.to(device), dy_in = dy.to(device);
  out.y = Tensor::empty(x.shape(), x.dtype(), device);
  out.rstd = Tensor::empty({rows}, DType::F32, device);
  ops::rmsnorm_forward(stream, out.y, out.rstd, x_in, w_in, params);
  const Tensor rstd = backward_rstd.defined() ? backward_rstd.to(device) : out.rstd;
  out.dx = Tensor::empty(x.shape(), x.dtype(), device);
  ops::rmsnorm_backward_input(stream, out.dx, dy_in, x_in, w_in, rstd, params);
  out.dw = dw0.to(device);
  ops::rmsnorm_backward_weight(stream, out.dw, dy_in, x_in, rstd);
  return out;
}

TEST(CudaRmsNorm, F32MatchesCpuForBothVariants) {
  MT_REQUIRE_GPU();
  for (bool zero_centered : {false, true}) {
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(::testing::Message() << shape_str(shape) << (zero_centered ? " zero-centred" : " plain"));
      Rng rng(41);
      const int64_t dim = shape.back();
      const int64_t rows = shape_numel(shape) / dim;
      const Tensor x = random_tensor(shape, DType::F32, rng, 2.0);
      const Tensor w = random_tensor({dim}, DType::F32, rng, 0.5);
      const Tensor dy = random_tensor(shape, DType::F32, rng);
      const Tensor dw0 = random_tensor({dim}, DType::F32, rng);
      const ops::RmsNormParams params{1e-6f, zero_centered};
      const Outputs want = run_all(Stream::cpu(), Device::cpu(), x, w, dy, dw0, params);
      // The backward ops on both sides take the CPU's rstd: each op is compared on the same inputs.
      const Outputs got = run_all(gpu(), Device::cuda(0), x, w, dy, dw0, params, want.rstd);
      const double e_y = relative_error(host_f32(got.y), want.y);
      const double e_rstd = relative_error(host_f32(got.rstd), want.rstd);
      const double e_dx = relative_error(host_f32(got.dx), want.dx);
      const double e_dw = relative_error(host_f32(got.dw), want.dw);
      EXPECT_LT(e_y, f32_tolerance(dim)) << "y";
      EXPECT_LT(e_rstd, f32_tolerance(dim)) << "rstd";
      EXPECT_LT(e_dx, f32_tolerance(dim)) << "dx";
      EXPECT_LT(e_dw, f32_tolerance(rows)) << "dw";
      std::printf("rmsnorm f32 %s%s: rel err y %.2e rstd %.2e dx %.2e dw %.2e\n", shape_str(shape).c_str(),
                  zero_centered ? " zc" : "", e_y, e_rstd, e_dx, e_dw);
    }
  }
}

TEST(CudaRmsNorm, Bf16ActivationsMatchCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (bool zero_centered : {false, true}) {
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(::testing::Message() << shape_str(shape) << (zero_centered ? " zero-centred" : " plain"));
      Rng rng(42);
      const int64_t dim = shape.back();
      const int64_t rows = shape_numel(shape) / dim;
      const Tensor x16 = random_tensor(shape, DType::F32, rng, 2.0).to(DType::BF16);
      const Tensor w = random_tensor({dim}, DType::F32, rng, 0.5);
      const Tensor dy16 = random_tensor(shape, DType::F32, rng).to(DType::BF16);
      const Tensor dw0 = random_tensor({dim}, DType::F32, rng);
      const ops::RmsNormParams params{1e-6f, zero_centered};
      // The CPU computes in f32 from the same (exactly widened) values.
      const Outputs want =
          run_all(Stream::cpu(), Device::cpu(), x16.to(DType::F32), w, dy16.to(DType::F32), dw0, params);
      const Outputs got = run_all(gpu(), Device::cuda(0), x16, w, dy16, dw0, params, want.rstd);
      ASSERT_EQ(got.y.dtype(), DType::BF16);
      EXPECT_LT(relative_error(host_f32(got.y), want.y), kBf16Tolerance) << "y (bf16)";
      EXPECT_LT(relative_error(host_f32(got.dx), want.dx), kBf16Tolerance) << "dx (bf16)";
      // rstd and dw are f32 outputs computed in f32 from exact inputs: the f32 bounds hold.
      EXPECT_LT(relative_error(host_f32(got.rstd), want.rstd), f32_tolerance(dim)) << "rstd";
      EXPECT_LT(relative_error(host_f32(got.dw), want.dw), f32_tolerance(rows)) << "dw";
    }
  }
}

TEST(CudaRmsNorm, BackwardInputMayOverwriteDy) {
  MT_REQUIRE_GPU();
  Rng rng(43);
  const Shape shape = {64, 4096};
  const Tensor x = on_gpu(random_tensor(shape, DType::F32, rng));
  const Tensor w = on_gpu(random_tensor({4096}, DType::F32, rng));
  const Tensor dy = random_tensor(shape, DType::F32, rng);
  const ops::RmsNormParams params{1e-6f, true};
  Tensor y = Tensor::empty(shape, DType::F32, Device::cuda(0));
  Tensor rstd = Tensor::empty({64}, DType::F32, Device::cuda(0));
  ops::rmsnorm_forward(gpu(), y, rstd, x, w, params);
  Tensor separate = Tensor::empty(shape, DType::F32, Device::cuda(0));
  ops::rmsnorm_backward_input(gpu(), separate, on_gpu(dy), x, w, rstd, params);
  Tensor in_place = on_gpu(dy);
  ops::rmsnorm_backward_input(gpu(), in_place, in_place, x, w, rstd, params);
  EXPECT_TRUE(same_bytes(in_place, separate));
}

TEST(CudaRmsNorm, RowResultsDoNotDependOnOtherRows) {
  MT_REQUIRE_GPU();
  // A row's forward and input gradient are the same bits whether it is alone or among 999 other rows: for a row of a
  // whole warp (896), of half a warp (128 in spans of 8), of a quarter (40; 7 element by element).
  for (const int64_t dim : {896, 128, 40, 7}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " D = " << dim);
      Rng rng(44);
      const Tensor x_all = random_tensor({1000, dim}, DType::F32, rng).to(dtype);
      const Tensor dy_all = random_tensor({1000, dim}, DType::F32, rng).to(dtype);
      const Tensor w = random_tensor({dim}, DType::F32, rng);
      const Tensor dw0 = Tensor::zeros({dim}, DType::F32);
      const ops::RmsNormParams params{1e-6f, false};
      const Outputs all = run_all(gpu(), Device::cuda(0), x_all, w, dy_all, dw0, params);
      const Outputs one =
          run_all(gpu(), Device::cuda(0), x_all.slice(0, 1).clone(), w, dy_all.slice(0, 1).clone(), dw0, params);
      EXPECT_TRUE(same_bytes(one.y, all.y.to(Device::cpu()).slice(0, 1).clone())) << "y";
      EXPECT_TRUE(same_bytes(one.rstd, all.rstd.to(Device::cpu()).slice(0, 1).clone())) << "rstd";
      EXPECT_TRUE(same_bytes(one.dx, all.dx.to(Device::cpu()).slice(0, 1).clone())) << "dx";
      // The last row, in the last (partly filled) warp.
      const Outputs last = run_all(gpu(), Device::cuda(0), x_all.slice(999, 1000).clone(), w,
                                   dy_all.slice(999, 1000).clone(), dw0, params);
      EXPECT_TRUE(same_bytes(last.y, all.y.to(Device::cpu()).slice(999, 1000).clone())) << "last y";
      EXPECT_TRUE(same_bytes(last.dx, all.dx.to(Device::cpu()).slice(999, 1000).clone())) << "last dx";
    }
  }
}

TEST(CudaRmsNorm, RepeatedRunsGiveIdenticalBits) {
  MT_REQUIRE_GPU();
  Rng rng(45);
  const Shape shape = {4096, 1024};  // dw sums 64 blocks of 64 rows, then their sums
  const Tensor x = random_tensor(shape, DType::F32, rng).to(DType::BF16);
  const Tensor dy = random_tensor(shape, DType::F32, rng).to(DType::BF16);
  const Tensor w = random_tensor({1024}, DType::F32, rng);
  const Tensor dw0 = Tensor::zeros({1024}, DType::F32);
  const ops::RmsNormParams params{1e-5f, false};
  const Outputs first = run_all(gpu(), Device::cuda(0), x, w, dy, dw0, params);
  const Outputs second = run_all(gpu(), Device::cuda(0), x, w, dy, dw0, params);
  EXPECT_TRUE(same_bytes(first.y, second.y)) << "y";
  EXPECT_TRUE(same_bytes(first.rstd, second.rstd)) << "rstd";
  EXPECT_TRUE(same_bytes(first.dx, second.dx)) << "dx";
  EXPECT_TRUE(same_bytes(first.dw, second.dw)) << "dw";
}

// The weight gradient's summation bound: each column's sum is a chain of additions, each erring by at most
// u sum |terms| (u = 2^-24), and each product rounds once more (a term's u |term|). Returns the columns of dw (on the
// GPU) further from dw0 + sum_n dy x rstd (in f64 on the host) than `chain` such additions allow.
int64_t columns_over_summation_bound(const Tensor& dw, const Tensor& dw0, const Tensor& dy, const Tensor& x,
                                     const Tensor& rstd, double chain) {
  const Tensor got = host_f32(dw), x32 = host_f32(x), dy32 = host_f32(dy), r = host_f32(rstd);
  const int64_t dim = dw0.numel(), rows = r.numel();
  int64_t over = 0;
  for (int64_t d = 0; d < dim; ++d) {
    double sum = dw0.data<float>()[d], magnitude = std::fabs(sum);
    for (int64_t n = 0; n < rows; ++n) {
      const double term = static_cast<double>(dy32.data<float>()[n * dim + d]) *
                          (static_cast<double>(x32.data<float>()[n * dim + d]) * r.data<float>()[n]);
      sum += term;
      magnitude += std::fabs(term);
    }
    if (std::fabs(got.data<float>()[d] - sum) > chain * std::ldexp(1.0, -24) * magnitude) ++over;
  }
  return over;
}

// rmsnorm_backward_weight's chain: at most 32 + 8 additions a level (a row lane's rows, then the lanes) over levels
// of 64-row blocks of terms and then 256-row blocks of sums, and one into dw (+ 2 for the products' rounding).
double weight_kernel_chain(int64_t rows) {
  int levels = 1;
  for (int64_t sums = rows, per_block = 64; sums > per_block; sums = (sums + per_block - 1) / per_block) {
    ++levels;
    per_block = 256;
  }
  return 40.0 * levels + 3.0;
}

// The one-pass backward's chain: a warp's rows (4 a warp over at most 2048 blocks of 8 warps), the block's 8 warps,
// then add_column_sums' levels over the blocks' sums (40 each) and one into dw (+ 2 for the products).
double one_pass_chain(int64_t rows) {
  const int64_t blocks = std::min<int64_t>((rows + 31) / 32, 2048), warps = 8 * blocks;
  int levels = 1;
  for (int64_t sums = blocks; sums > 256; sums = (sums + 255) / 256) ++levels;
  return static_cast<double>((rows + warps - 1) / warps + 8 + 40 * levels + 3);
}

// Whether the CUDA backward takes rows of `dim` elements in one pass (aligned tensors); the CUDA tests alone ask.
bool takes_one_pass([[maybe_unused]] int64_t dim) {
#if MOETRAIN_HAS_CUDA
  return ops::cuda::rmsnorm_backward_in_one_pass(dim);
#else
  return false;
#endif
}

#if MOETRAIN_HAS_CUDA
// The one pass's row widths (host code: no GPU needed): whole spans of 8 elements, 129 to 2048 a row.
TEST(CudaRmsNormBackward, OnePassTakesWholeSpansOf129To2048Elements) {
  for (const int64_t dim : {136, 1536, 2000, 2048}) EXPECT_TRUE(takes_one_pass(dim)) << dim;
  for (const int64_t dim : {8, 64, 128, 130, 1537, 2056, 4096}) EXPECT_FALSE(takes_one_pass(dim)) << dim;
}
#endif

TEST(CudaRmsNorm, WeightGradientOfManyRowsIsWithinItsSummationBound) {
  MT_REQUIRE_GPU();
  // dw over one to four levels of block sums (blocks of 64 rows of terms, then of 256 rows of sums; past 65,535
  // blocks of 64 rows the grid strides over them), 16-byte spans and single columns, bf16 and f32 terms, against an
  // f64 sum on the host. Each column's sum is a chain of at most 32 + 8 additions a level (a row lane's rows, then
  // the lanes) and one into dw, so it errs by at most (40 levels + 1) u sum |terms| (u = 2^-24); the products each
  // round once more (one u |term| each).
  struct Case {
    int64_t rows, dim;
    DType dtype;
  };
  for (const Case& c :
       {Case{60, 64, DType::F32}, Case{200, 64, DType::F32}, Case{8200, 2048, DType::BF16}, Case{70001, 8, DType::F32},
        Case{66000, 33, DType::BF16}, Case{262144, 128, DType::BF16}, Case{65536 * 256 + 300, 8, DType::BF16}}) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.dim << " " << dtype_name(c.dtype));
    Rng rng(46);
    const Tensor x = random_tensor({c.rows, c.dim}, DType::F32, rng).to(c.dtype);
    const Tensor dy = random_tensor({c.rows, c.dim}, DType::F32, rng).to(c.dtype);
    const Tensor rstd = random_tensor({c.rows}, DType::F32, rng, 1.0);
    const Tensor dw0 = random_tensor({c.dim}, DType::F32, rng);
    Tensor dw = on_gpu(dw0);
    ops::rmsnorm_backward_weight(gpu(), dw, on_gpu(dy), on_gpu(x), on_gpu(rstd));
    EXPECT_EQ(columns_over_summation_bound(dw, dw0, dy, x, rstd, weight_kernel_chain(c.rows)), 0)
        << "columns over their summation bound";
    Tensor again = on_gpu(dw0);
    ops::rmsnorm_backward_weight(gpu(), again, on_gpu(dy), on_gpu(x), on_gpu(rstd));
    EXPECT_TRUE(same_bytes(again, dw)) << "a second run";
  }
}

// The whole backward in one op: dx with the bits of the CUDA input gradient op (with its addend, and over dy), dw
// within the summation bound of its order against an f64 sum, and the same bits again on a second run. The shapes
// take the one-pass kernel (16-byte spans, 129 to 2048 a row: whole and partial 256-column spans, a grid that strides
// past 2048 blocks, bf16 gradients of an f32 residual stream) and the two-kernel path (narrow rows, rows past 2048,
// odd widths). Each column's sum is a chain of a warp's rows, the block's 8 warps, at most 40 additions a level of
// add_column_sums and one into dw, each adding at most u sum |terms| (u = 2^-24), the products one more each.
TEST(CudaRmsNormBackward, MatchesTheSeparateOpsAndItsSummationBound) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t rows, dim;
    DType x_dtype, dy_dtype;
    bool zero_centered, addend, in_place;
  };
  for (const Case& c : {Case{8192, 2048, DType::F32, DType::BF16, false, true, false},
                        Case{300, 1536, DType::BF16, DType::BF16, true, true, false},
                        Case{77, 2000, DType::F32, DType::F32, false, false, true},
                        Case{70001, 256, DType::BF16, DType::BF16, false, false, false},
                        Case{33, 136, DType::F32, DType::F32, true, true, false},
                        Case{1000, 128, DType::BF16, DType::BF16, false, true, false},
                        Case{40, 4096, DType::F32, DType::BF16, false, true, false},
                        Case{50, 1537, DType::F32, DType::F32, false, false, false}}) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.dim << ", x " << dtype_name(c.x_dtype) << ", dy "
                                      << dtype_name(c.dy_dtype) << (c.zero_centered ? ", zero-centred" : "")
                                      << (c.addend ? ", addend" : "") << (c.in_place ? ", dx over dy" : ""));
    Rng rng(47);
    const ops::RmsNormParams params{1e-6f, c.zero_centered};
    const Tensor x = on_gpu(random_tensor({c.rows, c.dim}, DType::F32, rng).to(c.x_dtype));
    const Tensor dy = on_gpu(random_tensor({c.rows, c.dim}, DType::F32, rng).to(c.dy_dtype));
    const Tensor w = on_gpu(random_tensor({c.dim}, DType::F32, rng));
    const Tensor addend = c.addend ? on_gpu(random_tensor({c.rows, c.dim}, DType::F32, rng).to(c.x_dtype)) : Tensor();
    const Tensor dw0 = random_tensor({c.dim}, DType::F32, rng);
    Tensor y = Tensor::empty({c.rows, c.dim}, c.dy_dtype, Device::cuda(0));
    Tensor rstd = Tensor::empty({c.rows}, DType::F32, Device::cuda(0));
    ops::rmsnorm_forward(gpu(), y, rstd, x, w, params);

    Tensor want_dx = Tensor::empty(x.shape(), c.x_dtype, Device::cuda(0));
    if (c.addend) {
      ops::rmsnorm_backward_input_add(gpu(), want_dx, dy, x, w, rstd, params, addend);
    } else {
      ops::rmsnorm_backward_input(gpu(), want_dx, dy, x, w, rstd, params);
    }
    const auto run = [&] {
      Tensor dy_in = dy.clone(), dw = on_gpu(dw0);
      Tensor dx = c.in_place ? dy_in : Tensor::empty(x.shape(), c.x_dtype, Device::cuda(0));
      ops::rmsnorm_backward(gpu(), dx, dw, dy_in, x, w, rstd, params, addend);
      return std::pair{dx, dw};
    };
    const auto [dx, dw] = run();
    EXPECT_TRUE(same_bytes(dx, want_dx)) << "dx against rmsnorm_backward_input";

    // The tensors here are 16-byte aligned, so the row width alone says which path ran.
    const double chain = takes_one_pass(c.dim) ? one_pass_chain(c.rows) : weight_kernel_chain(c.rows);
    EXPECT_EQ(columns_over_summation_bound(dw, dw0, dy, x, rstd, chain), 0) << "columns of dw over their summation bound";
    const auto [dx_again, dw_again] = run();
    EXPECT_TRUE(same_bytes(dw_again, dw)) << "a second run";
  }
}

TEST(CudaRmsNorm, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  const Tensor x = Tensor::zeros({2, 8}, DType::BF16, cuda);
  Tensor y = Tensor::zeros({2, 8}, DType::BF16, cuda);
  Tensor rstd = Tensor::zeros({2}, DType::F32, cuda);
  const ops::RmsNormParams params;
  expect_error([&] { ops::rmsnorm_forward(gpu(), y, rstd, x, Tensor::zeros({8}, DType::BF16, cuda), params); },
               {"rmsnorm_forward: w", "expected dtype f32", "bf16"});
  Tensor rstd16 = Tensor::zeros({2}, DType::BF16, cuda);
  expect_error([&] { ops::rmsnorm_forward(gpu(), y, rstd16, x, Tensor::zeros({8}, DType::F32, cuda), params); },
               {"rmsnorm_forward: rstd", "expected dtype f32", "bf16"});
  Tensor y64 = Tensor::zeros({2, 8}, DType::F64, cuda);
  expect_error(
      [&] {
        ops::rmsnorm_forward(gpu(), y64, rstd, Tensor::zeros({2, 8}, DType::F64, cuda),
                             Tensor::zeros({8}, DType::F32, cuda), params);
      },
      {"rmsnorm_forward", "x", "f32 or bf16", "f64"});
  Tensor dw = Tensor::zeros({8}, DType::F32);
  expect_error([&] { ops::rmsnorm_backward_weight(gpu(), dw, x, x, rstd); },
               {"rmsnorm_backward_weight", "dw", "stream's device cuda:0", "on cpu"});
}

// The fused op's outputs, on the device of its inputs.
struct AddNormOutputs {
  Tensor sum, y, rstd;
};

AddNormOutputs fused_add_rmsnorm(Stream& stream, const Tensor& a, const Tensor& b, const Tensor& w,
                                 const ops::RmsNormParams& params) {
  const int64_t rows = a.numel() / a.size(-1);
  const Device device = a.device();
  AddNormOutputs o{Tensor::empty(a.shape(), a.dtype(), device), Tensor::empty(a.shape(), a.dtype(), device),
                   Tensor::empty({rows}, DType::F32, device)};
  ops::add_rmsnorm_forward(stream, o.sum, o.y, o.rstd, a, b, w, params);
  return o;
}

// add_forward then rmsnorm_forward, the two ops the fused one replaces.
AddNormOutputs add_then_rmsnorm(Stream& stream, const Tensor& a, const Tensor& b, const Tensor& w,
                                const ops::RmsNormParams& params) {
  const int64_t rows = a.numel() / a.size(-1);
  const Device device = a.device();
  AddNormOutputs o{Tensor::empty(a.shape(), a.dtype(), device), Tensor::empty(a.shape(), a.dtype(), device),
                   Tensor::empty({rows}, DType::F32, device)};
  ops::add_forward(stream, o.sum, a, b);
  ops::rmsnorm_forward(stream, o.y, o.rstd, o.sum, w, params);
  return o;
}

TEST(CudaAddRmsNorm, MatchesCudaAddThenRmsNormBitwise) {
  MT_REQUIRE_GPU();
  // The fused kernel runs add_forward's element code (f32 add, rounded to the dtype) and forward_kernel's row code
  // on that rounded value, in the same lane layout: the same bits, f32 and bf16.
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool zero_centered : {false, true}) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " " << shape_str(shape) << (zero_centered ? " zero-centred" : " plain"));
        Rng rng(46);
        const Tensor a = on_gpu(random_tensor(shape, DType::F32, rng, 2.0).to(dtype));
        const Tensor b = on_gpu(random_tensor(shape, DType::F32, rng, 0.5).to(dtype));
        const Tensor w = on_gpu(random_tensor({shape.back()}, DType::F32, rng, 0.5));
        const ops::RmsNormParams params{1e-6f, zero_centered};
        const AddNormOutputs got = fused_add_rmsnorm(gpu(), a, b, w, params);
        const AddNormOutputs want = add_then_rmsnorm(gpu(), a, b, w, params);
        EXPECT_TRUE(same_bytes(got.sum, want.sum)) << "sum differs from add_forward's";
        EXPECT_TRUE(same_bytes(got.y, want.y)) << "y differs from rmsnorm_forward(add_forward(a, b))";
        EXPECT_TRUE(same_bytes(got.rstd, want.rstd)) << "rstd differs from rmsnorm_forward's";
      }
    }
  }
}

TEST(CudaAddRmsNorm, MatchesCpuReference) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " " << shape_str(shape));
      Rng rng(47);
      const int64_t dim = shape.back();
      const Tensor a = random_tensor(shape, DType::F32, rng, 2.0).to(dtype);
      const Tensor b = random_tensor(shape, DType::F32, rng, 0.5).to(dtype);
      const Tensor w = random_tensor({dim}, DType::F32, rng, 0.5);
      const ops::RmsNormParams params{1e-6f, false};
      const AddNormOutputs got = fused_add_rmsnorm(gpu(), on_gpu(a), on_gpu(b), on_gpu(w), params);
      // The CPU adds in f32 from the exactly widened inputs; for bf16 that sum is then rounded to bf16 (as the GPU
      // stores it) before the CPU norm reads it.
      Tensor sum_cpu = Tensor::empty(shape, DType::F32);
      ops::add_forward(Stream::cpu(), sum_cpu, a.to(DType::F32), b.to(DType::F32));
      if (dtype == DType::BF16) sum_cpu = testing::rounded_to_bf16(sum_cpu);
      Tensor y_cpu = Tensor::empty(shape, DType::F32), rstd_cpu = Tensor::empty({shape_numel(shape) / dim}, DType::F32);
      ops::rmsnorm_forward(Stream::cpu(), y_cpu, rstd_cpu, sum_cpu, w, params);
      // One correctly rounded f32 addition (then one rounding to bf16) on both sides: the same bits.
      EXPECT_TRUE(same_bytes(host_f32(got.sum), sum_cpu)) << "sum differs from the CPU's a + b";
      // y: f32 differs only by the sum-of-squares order (f32_tolerance); bf16 by its storage rounding.
      EXPECT_LT(relative_error(host_f32(got.y), y_cpu), dtype == DType::F32 ? f32_tolerance(dim) : kBf16Tolerance)
          << "y";
      EXPECT_LT(relative_error(host_f32(got.rstd), rstd_cpu), f32_tolerance(dim)) << "rstd";
    }
  }
}

TEST(CudaAddRmsNorm, SumMayOverwriteEitherResidualInput) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(48);
    const Shape shape = {64, 4096};
    const Tensor a = on_gpu(random_tensor(shape, DType::F32, rng).to(dtype));
    const Tensor b = on_gpu(random_tensor(shape, DType::F32, rng).to(dtype));
    const Tensor w = on_gpu(random_tensor({4096}, DType::F32, rng));
    const AddNormOutputs want = fused_add_rmsnorm(gpu(), a, b, w, {});
    for (int which : {0, 1}) {
      SCOPED_TRACE(which == 0 ? "sum aliases a" : "sum aliases b");
      Tensor a_inout = a.clone(), b_inout = b.clone();
      Tensor sum = which == 0 ? a_inout : b_inout;
      Tensor y = Tensor::empty(shape, dtype, Device::cuda(0));
      Tensor rstd = Tensor::empty({64}, DType::F32, Device::cuda(0));
      ops::add_rmsnorm_forward(gpu(), sum, y, rstd, a_inout, b_inout, w, {});
      EXPECT_TRUE(same_bytes(sum, want.sum)) << "sum";
      EXPECT_TRUE(same_bytes(y, want.y)) << "y";
      EXPECT_TRUE(same_bytes(rstd, want.rstd)) << "rstd";
    }
  }
}

TEST(CudaAddRmsNorm, RowResultsDoNotDependOnOtherRowsAndRepeatExactly) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(49);
    const int64_t dim = 896;
    const Tensor a = random_tensor({1000, dim}, DType::F32, rng).to(dtype);
    const Tensor b = random_tensor({1000, dim}, DType::F32, rng).to(dtype);
    const Tensor w = on_gpu(random_tensor({dim}, DType::F32, rng));
    const AddNormOutputs all = fused_add_rmsnorm(gpu(), on_gpu(a), on_gpu(b), w, {});
    const AddNormOutputs again = fused_add_rmsnorm(gpu(), on_gpu(a), on_gpu(b), w, {});
    EXPECT_TRUE(same_bytes(all.sum, again.sum)) << "sum, second run";
    EXPECT_TRUE(same_bytes(all.y, again.y)) << "y, second run";
    EXPECT_TRUE(same_bytes(all.rstd, again.rstd)) << "rstd, second run";
    const AddNormOutputs one =
        fused_add_rmsnorm(gpu(), on_gpu(a.slice(0, 1).clone()), on_gpu(b.slice(0, 1).clone()), w, {});
    EXPECT_TRUE(same_bytes(one.y, all.y.to(Device::cpu()).slice(0, 1).clone())) << "y of row 0 alone";
    EXPECT_TRUE(same_bytes(one.rstd, all.rstd.to(Device::cpu()).slice(0, 1).clone())) << "rstd of row 0 alone";
  }
}

TEST(CudaAddRmsNorm, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  const Tensor a = Tensor::zeros({2, 8}, DType::BF16, cuda);
  Tensor sum = Tensor::zeros({2, 8}, DType::BF16, cuda), y = Tensor::zeros({2, 8}, DType::BF16, cuda);
  Tensor rstd = Tensor::zeros({2}, DType::F32, cuda);
  const Tensor w = Tensor::zeros({8}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::add_rmsnorm_forward(gpu(), sum, y, rstd, a, Tensor::zeros({2, 8}, DType::F32, cuda), w, {});
      },
      {"add_rmsnorm_forward", "y in b's (f32)", "found sum bf16 and y bf16"});
  expect_error(
      [&] {
        ops::add_rmsnorm_forward(gpu(), sum, y, rstd, Tensor::zeros({2, 8}, DType::F64, cuda), a, w, {});
      },
      {"add_rmsnorm_forward", "a", "f32 or bf16", "f64"});
  expect_error([&] { ops::add_rmsnorm_forward(gpu(), sum, y, rstd, a, a, Tensor::zeros({8}, DType::BF16, cuda), {}); },
               {"add_rmsnorm_forward: w", "expected dtype f32", "bf16"});
  expect_error(
      [&] {
        ops::add_rmsnorm_forward(gpu(), sum, Tensor::zeros({2, 8}, DType::BF16), rstd, a, a, w, {});
      },
      {"add_rmsnorm_forward", "y", "stream's device cuda:0", "on cpu"});
}

}  // namespace
}  // namespace moetrain
