// Tests for the CUDA SwiGLU kernels (ops/cuda/activation.*) through the public ops, plain and clamped (GPT-OSS):
// forward and backward against the CPU reference in f32 and bf16 (odd widths, one element, large rows; for the clamped
// one inputs exactly at, just beyond and far beyond the limits), the exact zero gradient at and beyond the limits,
// determinism and argument checks; the sigmoid gate (a gate per element and per row) likewise. Run on a GPU; skipped
// elsewhere.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/activation.h"
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

// Per element a handful of f32 operations with expf (within 2 ulp) where the CPU's std::exp is within 1 ulp, and
// nvcc may fuse a multiply-add: a few ulp per element, so 1e-6 relative.
constexpr double kF32Tolerance = 1e-6;
// bf16 outputs are the f32 result rounded to 8 significant bits: up to 2^-9 = 2e-3 relative per element.
constexpr double kBf16Tolerance = 1e-2;

// gate_up [N, 2I]: one element, an odd width, a row wider than a block, an expert's width, no rows.
const std::vector<Shape> kShapes = {{1, 2}, {7, 602}, {3, 3000}, {256, 2 * 1408}, {0, 16}};

TEST(CudaSwiglu, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape_str(shape));
    Rng rng(61);
    const int64_t rows = shape[0], width = shape[1] / 2;
    const Tensor gate_up = random_tensor(shape, DType::F32, rng, 3.0);
    const Tensor dy = random_tensor({rows, width}, DType::F32, rng);
    Tensor y_cpu = Tensor::empty({rows, width}, DType::F32);
    ops::swiglu_forward(Stream::cpu(), y_cpu, gate_up);
    Tensor y_gpu = Tensor::empty({rows, width}, DType::F32, Device::cuda(0));
    ops::swiglu_forward(gpu(), y_gpu, on_gpu(gate_up));
    Tensor d_cpu = Tensor::empty(shape, DType::F32);
    ops::swiglu_backward(Stream::cpu(), d_cpu, dy, gate_up);
    Tensor d_gpu = Tensor::empty(shape, DType::F32, Device::cuda(0));
    ops::swiglu_backward(gpu(), d_gpu, on_gpu(dy), on_gpu(gate_up));
    const double e_y = relative_error(host_f32(y_gpu), y_cpu);
    const double e_d = relative_error(host_f32(d_gpu), d_cpu);
    EXPECT_LT(e_y, kF32Tolerance) << "y";
    EXPECT_LT(e_d, kF32Tolerance) << "dgate_up";
    std::printf("swiglu f32 %s: rel err y %.2e dgate_up %.2e\n", shape_str(shape).c_str(), e_y, e_d);
  }
}

TEST(CudaSwiglu, Bf16MatchesCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape_str(shape));
    Rng rng(62);
    const int64_t rows = shape[0], width = shape[1] / 2;
    const Tensor gate_up16 = random_tensor(shape, DType::F32, rng, 3.0).to(DType::BF16);
    const Tensor dy16 = random_tensor({rows, width}, DType::F32, rng).to(DType::BF16);
    Tensor y_cpu = Tensor::empty({rows, width}, DType::F32);
    ops::swiglu_forward(Stream::cpu(), y_cpu, gate_up16.to(DType::F32));
    Tensor y_gpu = Tensor::empty({rows, width}, DType::BF16, Device::cuda(0));
    ops::swiglu_forward(gpu(), y_gpu, on_gpu(gate_up16));
    Tensor d_cpu = Tensor::empty(shape, DType::F32);
    ops::swiglu_backward(Stream::cpu(), d_cpu, dy16.to(DType::F32), gate_up16.to(DType::F32));
    Tensor d_gpu = Tensor::empty(shape, DType::BF16, Device::cuda(0));
    ops::swiglu_backward(gpu(), d_gpu, on_gpu(dy16), on_gpu(gate_up16));
    EXPECT_LT(relative_error(host_f32(y_gpu), y_cpu), kBf16Tolerance) << "y";
    EXPECT_LT(relative_error(host_f32(d_gpu), d_cpu), kBf16Tolerance) << "dgate_up";
  }
}

TEST(CudaSwiglu, RepeatedRunsGiveIdenticalBits) {
  MT_REQUIRE_GPU();
  Rng rng(63);
  const Tensor gate_up = on_gpu(random_tensor({512, 2816}, DType::F32, rng).to(DType::BF16));
  const Tensor dy = on_gpu(random_tensor({512, 1408}, DType::F32, rng).to(DType::BF16));
  Tensor first = Tensor::empty({512, 2816}, DType::BF16, Device::cuda(0));
  Tensor second = Tensor::empty({512, 2816}, DType::BF16, Device::cuda(0));
  ops::swiglu_backward(gpu(), first, dy, gate_up);
  ops::swiglu_backward(gpu(), second, dy, gate_up);
  EXPECT_TRUE(same_bytes(first, second));
}

TEST(CudaSwiglu, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor y64 = Tensor::zeros({2, 4}, DType::F64, cuda);
  expect_error(
      [&] {
        ops::swiglu_forward(gpu(), y64, Tensor::zeros({2, 8}, DType::F64, cuda));
      },
      {"swiglu_forward", "gate_up", "f32 or bf16", "f64"});
  Tensor y16 = Tensor::zeros({2, 4}, DType::BF16, cuda);
  expect_error(
      [&] {
        ops::swiglu_forward(gpu(), y16, Tensor::zeros({2, 8}, DType::F32, cuda));
      },
      {"swiglu_forward", "y [N, I]", "expected dtype f32", "bf16"});
  Tensor y = Tensor::zeros({2, 4}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::swiglu_forward(gpu(), y, Tensor::zeros({2, 8}, DType::F32));
      },
      {"swiglu_forward", "gate_up", "stream's device cuda:0", "on cpu"});
}

// gate_up drawn from N(0, 6^2) (a quarter beyond +-7) with every fifth entry replaced by an edge value: exactly
// +-limit, the next bf16 beyond 7 (7.03125, so the edges survive the bf16 rounding), far beyond, and 0.
Tensor clamped_inputs(const Shape& shape, Rng& rng) {
  Tensor t = random_tensor(shape, DType::F32, rng, 6.0);
  const float edges[] = {7.0f, -7.0f, 7.03125f, -7.03125f, 20.0f, -20.0f, 0.0f};
  float* v = t.data<float>();
  for (int64_t i = 0; i < t.numel(); i += 5) v[i] = edges[(i / 5) % 7];
  return t;
}

const ops::ClampedSwigluParams kGptOss{};
const ops::ClampedSwigluParams kOther{1.0f, 3.0f};

TEST(CudaClampedSwiglu, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  for (const ops::ClampedSwigluParams& params : {kGptOss, kOther}) {
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(shape_str(shape) + " limit " + std::to_string(params.limit));
      Rng rng(64);
      const int64_t rows = shape[0], width = shape[1] / 2;
      const Tensor gate_up = clamped_inputs(shape, rng);
      const Tensor dy = random_tensor({rows, width}, DType::F32, rng);
      Tensor y_cpu = Tensor::empty({rows, width}, DType::F32);
      ops::clamped_swiglu_forward(Stream::cpu(), y_cpu, gate_up, params);
      Tensor y_gpu = Tensor::empty({rows, width}, DType::F32, Device::cuda(0));
      ops::clamped_swiglu_forward(gpu(), y_gpu, on_gpu(gate_up), params);
      Tensor d_cpu = Tensor::empty(shape, DType::F32);
      ops::clamped_swiglu_backward(Stream::cpu(), d_cpu, dy, gate_up, params);
      Tensor d_gpu = Tensor::empty(shape, DType::F32, Device::cuda(0));
      ops::clamped_swiglu_backward(gpu(), d_gpu, on_gpu(dy), on_gpu(gate_up), params);
      const double e_y = relative_error(host_f32(y_gpu), y_cpu);
      const double e_d = relative_error(host_f32(d_gpu), d_cpu);
      EXPECT_LT(e_y, kF32Tolerance) << "y";
      EXPECT_LT(e_d, kF32Tolerance) << "dgate_up";
      // The clamps' branches compare the same input values on both backends: the zeros are at the same places.
      const std::vector<float> dc = d_cpu.to_vector<float>(), dg = host_f32(d_gpu).to_vector<float>();
      for (size_t i = 0; i < dc.size(); ++i) {
        if (dc[i] == 0.0f) {
          EXPECT_EQ(dg[i], 0.0f) << "element " << i;
        }
      }
      std::printf("clamped swiglu f32 %s: rel err y %.2e dgate_up %.2e\n", shape_str(shape).c_str(), e_y, e_d);
    }
  }
}

TEST(CudaClampedSwiglu, Bf16MatchesCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape_str(shape));
    Rng rng(65);
    const int64_t rows = shape[0], width = shape[1] / 2;
    const Tensor gate_up16 = clamped_inputs(shape, rng).to(DType::BF16);
    const Tensor dy16 = random_tensor({rows, width}, DType::F32, rng).to(DType::BF16);
    Tensor y_cpu = Tensor::empty({rows, width}, DType::F32);
    ops::clamped_swiglu_forward(Stream::cpu(), y_cpu, gate_up16.to(DType::F32), kGptOss);
    Tensor y_gpu = Tensor::empty({rows, width}, DType::BF16, Device::cuda(0));
    ops::clamped_swiglu_forward(gpu(), y_gpu, on_gpu(gate_up16), kGptOss);
    Tensor d_cpu = Tensor::empty(shape, DType::F32);
    ops::clamped_swiglu_backward(Stream::cpu(), d_cpu, dy16.to(DType::F32), gate_up16.to(DType::F32), kGptOss);
    Tensor d_gpu = Tensor::empty(shape, DType::BF16, Device::cuda(0));
    ops::clamped_swiglu_backward(gpu(), d_gpu, on_gpu(dy16), on_gpu(gate_up16), kGptOss);
    EXPECT_LT(relative_error(host_f32(y_gpu), y_cpu), kBf16Tolerance) << "y";
    EXPECT_LT(relative_error(host_f32(d_gpu), d_cpu), kBf16Tolerance) << "dgate_up";
  }
}

// One row: gate at +limit, just beyond, far beyond, -limit, far below (no lower clamp on gate), just inside; up at
// +-limit and beyond, and just inside, with gate 1. The gradient is exactly 0 at and beyond a limit (torch 2.15's clamp
// backward) and passes elsewhere, in f32 and bf16 (6.96875 is the bf16 just inside 7).
TEST(CudaClampedSwiglu, GradientIsZeroAtAndBeyondTheLimits) {
  MT_REQUIRE_GPU();
  const std::vector<float> gate{7.0f, 7.03125f, 20.0f, -7.0f, -20.0f, 6.96875f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<float> up{0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 7.0f, -7.0f, 7.03125f, -9.0f, -6.96875f};
  const size_t n = gate.size();
  std::vector<float> gu = gate;
  gu.insert(gu.end(), up.begin(), up.end());
  const Tensor gate_up = Tensor::from_vector(gu, {1, static_cast<int64_t>(2 * n)});
  const Tensor dy = Tensor::from_vector(std::vector<float>(n, 1.5f), {1, static_cast<int64_t>(n)});
  Tensor d_cpu = Tensor::empty({1, static_cast<int64_t>(2 * n)}, DType::F32);
  ops::clamped_swiglu_backward(Stream::cpu(), d_cpu, dy, gate_up, kGptOss);
  const std::vector<float> dc = d_cpu.to_vector<float>();
  const std::vector<size_t> zero{0, 1, 2, n + 6, n + 7, n + 8, n + 9};
  const std::vector<size_t> passes{3, 4, 5, n + 5, n + 10};
  for (const DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor d_gpu = Tensor::empty({1, static_cast<int64_t>(2 * n)}, dtype, Device::cuda(0));
    ops::clamped_swiglu_backward(gpu(), d_gpu, on_gpu(dy.to(dtype)), on_gpu(gate_up.to(dtype)), kGptOss);
    const std::vector<float> dg = host_f32(d_gpu).to_vector<float>();
    for (const size_t i : zero) {
      EXPECT_EQ(dc[i], 0.0f) << "cpu element " << i;
      EXPECT_EQ(dg[i], 0.0f) << "gpu element " << i;
    }
    // bf16 stores the f32 result rounded to 8 significant bits (2^-9 relative); f32 within a few ulp.
    const double bound = dtype == DType::F32 ? kF32Tolerance : 4e-3;
    for (const size_t i : passes) {
      EXPECT_NE(dg[i], 0.0f) << "gpu element " << i;
      EXPECT_NEAR(dg[i], dc[i], bound * std::abs(dc[i])) << "element " << i;
    }
  }
}

TEST(CudaClampedSwiglu, RepeatedRunsGiveIdenticalBits) {
  MT_REQUIRE_GPU();
  Rng rng(66);
  const Tensor gate_up = on_gpu(clamped_inputs({512, 2880}, rng).to(DType::BF16));
  const Tensor dy = on_gpu(random_tensor({512, 1440}, DType::F32, rng).to(DType::BF16));
  Tensor first = Tensor::empty({512, 2880}, DType::BF16, Device::cuda(0));
  Tensor second = Tensor::empty({512, 2880}, DType::BF16, Device::cuda(0));
  ops::clamped_swiglu_backward(gpu(), first, dy, gate_up, kGptOss);
  ops::clamped_swiglu_backward(gpu(), second, dy, gate_up, kGptOss);
  EXPECT_TRUE(same_bytes(first, second));
}

TEST(CudaClampedSwiglu, RejectsF64AndBadParamsOnCuda) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor y64 = Tensor::zeros({2, 4}, DType::F64, cuda);
  expect_error(
      [&] {
        ops::clamped_swiglu_forward(gpu(), y64, Tensor::zeros({2, 8}, DType::F64, cuda), {});
      },
      {"clamped_swiglu_forward", "gate_up", "f32 or bf16", "f64"});
  Tensor y = Tensor::zeros({2, 4}, DType::F32, cuda);
  Tensor d = Tensor::zeros({2, 8}, DType::F32, cuda);
  const Tensor gate_up = Tensor::zeros({2, 8}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::clamped_swiglu_forward(gpu(), y, gate_up, {1.702f, -1.0f});
      },
      {"clamped_swiglu_forward", "limit (-1) must be finite and > 0"});
  expect_error(
      [&] {
        ops::clamped_swiglu_backward(gpu(), d, y, gate_up, {std::numeric_limits<float>::infinity(), 7.0f});
      },
      {"clamped_swiglu_backward", "alpha (inf) must be finite"});
}

// The sigmoid gate against the CPU: per element expf (2 ulp) and at most a fused multiply-add, so 1e-6 as SwiGLU; the
// row gate's gradient sums dy * x over up to 3000 columns, one warp per row in lane-strided partial sums where the
// CPU sums in ascending order (and nvcc may fuse each step into an FMA): both orders round ~3000 times at 2^-24 of a
// partial sum, so 1e-5 relative covers ~sqrt(3000) such differences with a margin, and a wrong term is off by O(1).
TEST(CudaSigmoidGate, F32AndBf16MatchCpu) {
  MT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 1}, {7, 301}, {3, 3000}, {256, 128}, {0, 16}};
  for (const Shape& shape : shapes) {
    for (const bool row_gate : {false, true}) {
      SCOPED_TRACE(shape_str(shape) + (row_gate ? " row gate" : " element gate"));
      Rng rng(71);
      const int64_t rows = shape[0];
      const Shape gate_shape = row_gate ? Shape{rows, 1} : shape;
      const Tensor x = random_tensor(shape, DType::F32, rng), dy = random_tensor(shape, DType::F32, rng);
      const Tensor gate = random_tensor(gate_shape, DType::F32, rng, 3.0);
      Tensor y = Tensor::empty(shape, DType::F32), dx = Tensor::empty(shape, DType::F32);
      Tensor dgate = Tensor::empty(gate_shape, DType::F32);
      ops::sigmoid_gate_forward(Stream::cpu(), y, x, gate);
      ops::sigmoid_gate_backward(Stream::cpu(), dx, dgate, dy, x, gate);
      Tensor y_gpu = Tensor::empty(shape, DType::F32, Device::cuda(0));
      Tensor dx_gpu = Tensor::empty(shape, DType::F32, Device::cuda(0));
      Tensor dgate_gpu = Tensor::empty(gate_shape, DType::F32, Device::cuda(0));
      ops::sigmoid_gate_forward(gpu(), y_gpu, on_gpu(x), on_gpu(gate));
      ops::sigmoid_gate_backward(gpu(), dx_gpu, dgate_gpu, on_gpu(dy), on_gpu(x), on_gpu(gate));
      EXPECT_LT(relative_error(host_f32(y_gpu), y), kF32Tolerance);
      EXPECT_LT(relative_error(host_f32(dx_gpu), dx), kF32Tolerance);
      EXPECT_LT(relative_error(host_f32(dgate_gpu), dgate), row_gate ? 1e-5 : kF32Tolerance);
      // bf16: the CPU on the rounded inputs, the GPU's outputs rounded once more.
      const Tensor xb = x.to(DType::BF16), gb = gate.to(DType::BF16), dyb = dy.to(DType::BF16);
      Tensor yr = Tensor::empty(shape, DType::F32), dxr = Tensor::empty(shape, DType::F32);
      Tensor dgr = Tensor::empty(gate_shape, DType::F32);
      ops::sigmoid_gate_forward(Stream::cpu(), yr, xb.to(DType::F32), gb.to(DType::F32));
      ops::sigmoid_gate_backward(Stream::cpu(), dxr, dgr, dyb.to(DType::F32), xb.to(DType::F32), gb.to(DType::F32));
      Tensor yb_gpu = Tensor::empty(shape, DType::BF16, Device::cuda(0));
      Tensor dxb_gpu = Tensor::empty(shape, DType::BF16, Device::cuda(0));
      Tensor dgb_gpu = Tensor::empty(gate_shape, DType::BF16, Device::cuda(0));
      ops::sigmoid_gate_forward(gpu(), yb_gpu, on_gpu(xb), on_gpu(gb));
      ops::sigmoid_gate_backward(gpu(), dxb_gpu, dgb_gpu, on_gpu(dyb), on_gpu(xb), on_gpu(gb));
      EXPECT_LT(relative_error(host_f32(yb_gpu), yr), kBf16Tolerance);
      EXPECT_LT(relative_error(host_f32(dxb_gpu), dxr), kBf16Tolerance);
      EXPECT_LT(relative_error(host_f32(dgb_gpu), dgr), kBf16Tolerance);
    }
  }
}

TEST(CudaSigmoidGate, RepeatedRunsGiveIdenticalBitsAndF64IsRefused) {
  MT_REQUIRE_GPU();
  Rng rng(72);
  const Tensor x = on_gpu(random_tensor({64, 500}, DType::F32, rng));
  const Tensor gate = on_gpu(random_tensor({64, 1}, DType::F32, rng)),
               dy = on_gpu(random_tensor({64, 500}, DType::F32, rng));
  Tensor dx1 = Tensor::empty({64, 500}, DType::F32, Device::cuda(0)),
         dx2 = Tensor::empty({64, 500}, DType::F32, Device::cuda(0));
  Tensor dg1 = Tensor::empty({64, 1}, DType::F32, Device::cuda(0)),
         dg2 = Tensor::empty({64, 1}, DType::F32, Device::cuda(0));
  ops::sigmoid_gate_backward(gpu(), dx1, dg1, dy, x, gate);
  ops::sigmoid_gate_backward(gpu(), dx2, dg2, dy, x, gate);
  EXPECT_TRUE(same_bytes(dx1, dx2));
  EXPECT_TRUE(same_bytes(dg1, dg2));
  const Tensor x64 = Tensor::zeros({2, 3}, DType::F64, Device::cuda(0));
  Tensor y64 = Tensor::zeros({2, 3}, DType::F64, Device::cuda(0));
  expect_error([&] { ops::sigmoid_gate_forward(gpu(), y64, x64, x64); }, {"expected x in f32 or bf16 (CUDA)"});
}

}  // namespace
}  // namespace moetrain
