// Tests for the ops that carry an f32 residual stream beside bf16 activations on CUDA (model.residual_dtype = f32
// under bf16 compute): RMSNorm forward / input and weight gradients with an f32 x and bf16 y or dy, the fused residual
// add + norm with an f32 residual and a bf16 mixer output, add_forward / accumulate of a bf16 addend into f32, and the
// token side of the permutation (permute_backward's dx, unpermute's y and dy) in f32 beside bf16 rows. Each against
// the CPU reference in f32 on the exactly widened bf16 values; the fused op against its two ops bit for bit; the
// refusals (mixes the kernels do not take, an in-place alias across dtypes, mixed dtypes on the CPU). The GPU cases
// are skipped without a GPU.
#include <cstdint>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/norm.h"
#include "ops/permute.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;
using testing::same_bytes;

// f32 results computed in f32 from the same values on both sides differ only by summation order (cuda_norm_test.cpp).
constexpr double kF32Tolerance = 1e-5;
// A bf16 result is the f32 one rounded to 8 significant bits.
constexpr double kBf16Tolerance = 1e-2;

const Device kCuda = Device::cuda(0);

Tensor widened(const Tensor& bf16) { return bf16.to(DType::F32); }

TEST(CudaResidualStream, NormReadsAnF32StreamAndWritesBf16) {
  MT_REQUIRE_GPU();
  for (bool zero_centered : {false, true}) {
    SCOPED_TRACE(zero_centered ? "zero-centred" : "plain");
    Rng rng(71);
    const Shape shape = {300, 1537};
    const int64_t rows = 300, dim = 1537;
    const Tensor x = random_tensor(shape, DType::F32, rng, 2.0);  // off the bf16 grid
    const Tensor w = random_tensor({dim}, DType::F32, rng, 0.5);
    const Tensor dy16 = random_tensor(shape, DType::F32, rng).to(DType::BF16);
    const ops::RmsNormParams params{1e-6f, zero_centered};

    Tensor y_cpu = Tensor::empty(shape, DType::F32), rstd_cpu = Tensor::empty({rows}, DType::F32);
    ops::rmsnorm_forward(Stream::cpu(), y_cpu, rstd_cpu, x, w, params);
    Tensor dx_cpu = Tensor::empty(shape, DType::F32);
    ops::rmsnorm_backward_input(Stream::cpu(), dx_cpu, widened(dy16), x, w, rstd_cpu, params);
    Tensor dw_cpu = Tensor::zeros({dim}, DType::F32);
    ops::rmsnorm_backward_weight(Stream::cpu(), dw_cpu, widened(dy16), x, rstd_cpu);

    const Tensor x_gpu = on_gpu(x), w_gpu = on_gpu(w), dy_gpu = on_gpu(dy16), rstd_in = on_gpu(rstd_cpu);
    Tensor y = Tensor::empty(shape, DType::BF16, kCuda), rstd = Tensor::empty({rows}, DType::F32, kCuda);
    ops::rmsnorm_forward(gpu(), y, rstd, x_gpu, w_gpu, params);
    Tensor dx = Tensor::empty(shape, DType::F32, kCuda);
    ops::rmsnorm_backward_input(gpu(), dx, dy_gpu, x_gpu, w_gpu, rstd_in, params);
    Tensor dw = Tensor::zeros({dim}, DType::F32, kCuda);
    ops::rmsnorm_backward_weight(gpu(), dw, dy_gpu, x_gpu, rstd_in);

    ASSERT_EQ(y.dtype(), DType::BF16);
    EXPECT_LT(relative_error(host_f32(y), y_cpu), kBf16Tolerance) << "y";
    EXPECT_LT(relative_error(host_f32(rstd), rstd_cpu), kF32Tolerance) << "rstd";
    // dx and dw are f32 results of f32 math on exact inputs: the f32 bound, not bf16's.
    EXPECT_LT(relative_error(host_f32(dx), dx_cpu), kF32Tolerance) << "dx";
    EXPECT_LT(relative_error(host_f32(dw), dw_cpu), kF32Tolerance) << "dw";

    // The same from an f32 dy (the MoE layers' post-norm gradient, summed in the stream's dtype).
    Tensor dx_f32_dy = Tensor::empty(shape, DType::F32, kCuda);
    ops::rmsnorm_backward_input(gpu(), dx_f32_dy, on_gpu(widened(dy16)), x_gpu, w_gpu, rstd_in, params);
    EXPECT_TRUE(same_bytes(dx_f32_dy, dx)) << "a bf16 dy and its widened f32 copy give the same bits";
  }
}

TEST(CudaResidualStream, FusedAddNormOfAnF32ResidualAndABf16OutputIsItsTwoOps) {
  MT_REQUIRE_GPU();
  Rng rng(72);
  const Shape shape = {257, 2048};
  const int64_t rows = 257, dim = 2048;
  const Tensor a = random_tensor(shape, DType::F32, rng, 3.0);
  const Tensor b16 = random_tensor(shape, DType::F32, rng).to(DType::BF16);
  const Tensor w = random_tensor({dim}, DType::F32, rng, 0.5);
  const ops::RmsNormParams params{1e-6f, false};

  Tensor sum = Tensor::empty(shape, DType::F32, kCuda), y = Tensor::empty(shape, DType::BF16, kCuda);
  Tensor rstd = Tensor::empty({rows}, DType::F32, kCuda);
  ops::add_rmsnorm_forward(gpu(), sum, y, rstd, on_gpu(a), on_gpu(b16), on_gpu(w), params);

  Tensor sum2 = Tensor::empty(shape, DType::F32, kCuda), y2 = Tensor::empty(shape, DType::BF16, kCuda);
  Tensor rstd2 = Tensor::empty({rows}, DType::F32, kCuda);
  ops::add_forward(gpu(), sum2, on_gpu(a), on_gpu(b16));
  ops::rmsnorm_forward(gpu(), y2, rstd2, sum2, on_gpu(w), params);
  EXPECT_TRUE(same_bytes(sum, sum2)) << "sum";
  EXPECT_TRUE(same_bytes(y, y2)) << "y";
  EXPECT_TRUE(same_bytes(rstd, rstd2)) << "rstd";

  // The sum is one f32 rounding of a + b, as the CPU adds the widened values: the same bits.
  Tensor sum_cpu = Tensor::empty(shape, DType::F32), y_cpu = Tensor::empty(shape, DType::F32);
  Tensor rstd_cpu = Tensor::empty({rows}, DType::F32);
  ops::add_rmsnorm_forward(Stream::cpu(), sum_cpu, y_cpu, rstd_cpu, a, widened(b16), w, params);
  EXPECT_TRUE(same_bytes(sum, sum_cpu)) << "sum against the CPU";
  EXPECT_LT(relative_error(host_f32(y), y_cpu), kBf16Tolerance) << "y against the CPU";
  EXPECT_LT(relative_error(host_f32(rstd), rstd_cpu), kF32Tolerance) << "rstd against the CPU";
}

TEST(CudaResidualStream, Bf16AddendsSumIntoAnF32Stream) {
  MT_REQUIRE_GPU();
  Rng rng(73);
  const Shape shape = {1000, 333};
  const Tensor acc = random_tensor(shape, DType::F32, rng, 2.0);
  const Tensor x16 = random_tensor(shape, DType::F32, rng).to(DType::BF16);
  Tensor want = acc.clone();
  ops::accumulate(Stream::cpu(), want, widened(x16));

  Tensor got = on_gpu(acc);
  ops::accumulate(gpu(), got, on_gpu(x16));
  EXPECT_TRUE(same_bytes(got, want)) << "accumulate";
  Tensor out = Tensor::empty(shape, DType::F32, kCuda);
  ops::add_forward(gpu(), out, on_gpu(acc), on_gpu(x16));
  EXPECT_TRUE(same_bytes(out, want)) << "add_forward";
  // And the other way round: an f32 addend into a bf16 sum rounds the f32 sum once.
  Tensor out16 = Tensor::empty(shape, DType::BF16, kCuda);
  ops::add_forward(gpu(), out16, on_gpu(x16), on_gpu(acc));
  EXPECT_TRUE(same_bytes(out16, want.to(DType::BF16))) << "bf16 out";
}

// Choices spread over the experts with one idle expert.
Tensor random_choices(int64_t tokens, int64_t top_k, int64_t experts, Rng& rng) {
  std::vector<int32_t> index(static_cast<size_t>(tokens * top_k));
  for (int32_t& e : index) e = static_cast<int32_t>(1 + rng.below(static_cast<uint64_t>(experts - 1)));
  return Tensor::from_vector<int32_t>(index, {tokens, top_k});
}

TEST(CudaResidualStream, PermutationsTokenSideInF32BesideBf16Rows) {
  MT_REQUIRE_GPU();
  Rng rng(74);
  const int64_t tokens = 200, top_k = 4, experts = 9, hidden = 520;
  const Tensor choices = random_choices(tokens, top_k, experts, rng);
  const ops::RoutingPlan cpu_plan = ops::make_routing_plan(Stream::cpu(), choices, experts);
  const ops::RoutingPlan gpu_plan = ops::make_routing_plan(gpu(), on_gpu(choices), experts);
  const Tensor rows16 = random_tensor({tokens * top_k, hidden}, DType::F32, rng).to(DType::BF16);
  const Tensor weight = random_tensor({tokens, top_k}, DType::F32, rng, 0.5);
  const Tensor dy = random_tensor({tokens, hidden}, DType::F32, rng);  // the stream's gradient, off the bf16 grid

  // unpermute_forward: the weighted sum of bf16 rows written to the f32 stream.
  Tensor y_cpu = Tensor::empty({tokens, hidden}, DType::F32);
  ops::unpermute_forward(Stream::cpu(), y_cpu, widened(rows16), weight, cpu_plan);
  Tensor y = Tensor::empty({tokens, hidden}, DType::F32, kCuda);
  ops::unpermute_forward(gpu(), y, on_gpu(rows16), on_gpu(weight), gpu_plan);
  EXPECT_TRUE(same_bytes(y, y_cpu)) << "y (the same f32 products and ascending sums)";

  // unpermute_backward: an f32 dy gives bf16 row gradients and f32 weight gradients.
  Tensor drows_cpu = Tensor::empty({tokens * top_k, hidden}, DType::F32);
  Tensor dweight_cpu = Tensor::empty({tokens, top_k}, DType::F32);
  ops::unpermute_backward(Stream::cpu(), drows_cpu, dweight_cpu, dy, widened(rows16), weight, cpu_plan);
  Tensor drows = Tensor::empty({tokens * top_k, hidden}, DType::BF16, kCuda);
  Tensor dweight = Tensor::empty({tokens, top_k}, DType::F32, kCuda);
  ops::unpermute_backward(gpu(), drows, dweight, on_gpu(dy), on_gpu(rows16), on_gpu(weight), gpu_plan);
  EXPECT_TRUE(same_bytes(drows, drows_cpu.to(DType::BF16))) << "d rows: one product, rounded once";
  EXPECT_LT(relative_error(host_f32(dweight), dweight_cpu), kF32Tolerance) << "d weight";

  // permute_backward: the bf16 row gradients summed per token into f32.
  Tensor dx_cpu = Tensor::empty({tokens, hidden}, DType::F32);
  ops::permute_backward(Stream::cpu(), dx_cpu, widened(rows16), cpu_plan);
  Tensor dx = Tensor::empty({tokens, hidden}, DType::F32, kCuda);
  ops::permute_backward(gpu(), dx, on_gpu(rows16), gpu_plan);
  EXPECT_TRUE(same_bytes(dx, dx_cpu)) << "dx (ascending f32 sums on both sides)";
}

TEST(CudaResidualStream, RefusesMixesTheKernelsDoNotTake) {
  MT_REQUIRE_GPU();
  const Tensor f32 = Tensor::zeros({4, 64}, DType::F32, kCuda);
  const Tensor bf16 = Tensor::zeros({4, 64}, DType::BF16, kCuda);
  const Tensor w = Tensor::zeros({64}, DType::F32, kCuda);
  Tensor rstd = Tensor::zeros({4}, DType::F32, kCuda);
  const ops::RmsNormParams params;
  expect_error(
      [&] {
        ops::add_rmsnorm_forward(gpu(), Tensor::zeros({4, 64}, DType::BF16, kCuda),
                                 Tensor::zeros({4, 64}, DType::BF16, kCuda), rstd, f32, bf16, w, params);
      },
      {"add_rmsnorm_forward", "expected sum in a's dtype (f32)", "found sum bf16"});
  expect_error(
      [&] {
        ops::rmsnorm_backward_input(gpu(), Tensor::zeros({4, 64}, DType::BF16, kCuda), bf16, f32, w, rstd, params);
      },
      {"rmsnorm_backward_input", "expected dx in x's dtype (f32) but found bf16"});
}

TEST(CudaResidualStream, AnInPlaceAliasAcrossDtypesIsRefused) {
  MT_REQUIRE_GPU();
  // A bf16 view of an f32 buffer's bytes: writing one dtype over the other would corrupt rows the kernel has not read.
  Tensor f32 = Tensor::zeros({4, 64}, DType::F32, kCuda);
  const Tensor bf16_view = Tensor::from_blob(f32.raw_data(), {4, 64}, DType::BF16, kCuda, nullptr);
  const Tensor w = Tensor::zeros({64}, DType::F32, kCuda);
  Tensor rstd = Tensor::zeros({4}, DType::F32, kCuda);
  expect_error(
      [&] {
        ops::rmsnorm_backward_input(gpu(), f32, bf16_view, Tensor::zeros({4, 64}, DType::F32, kCuda), w, rstd, {});
      },
      {"rmsnorm_backward_input", "dx may overwrite dy only in the same dtype", "dx is f32", "dy is bf16"});
  expect_error(
      [&] {
        ops::add_forward(gpu(), f32, Tensor::zeros({4, 64}, DType::F32, kCuda), bf16_view);
      },
      {"add_forward", "out may overwrite b only in the same dtype"});
}

TEST(ResidualStream, TheCpuTakesOneDtypePerOp) {
  // The CPU reference has no bf16: an f32 stream is its only stream, and a mix of f32 and f64 is refused by name.
  Tensor acc = Tensor::zeros({2, 8}, DType::F32);
  expect_error(
      [&] {
        ops::accumulate(Stream::cpu(), acc, Tensor::zeros({2, 8}, DType::F64));
      },
      {"accumulate: x", "f32", "f64"});
  Tensor y = Tensor::zeros({2, 8}, DType::F64), rstd = Tensor::zeros({2}, DType::F32);
  expect_error(
      [&] {
        ops::rmsnorm_forward(Stream::cpu(), y, rstd, Tensor::zeros({2, 8}, DType::F32), Tensor::zeros({8}, DType::F32),
                             {});
      },
      {"rmsnorm_forward: y", "f32", "f64"});
}

}  // namespace
}  // namespace moetrain
