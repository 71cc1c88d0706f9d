// Tests for the CUDA SwiGLU kernels (ops/cuda/activation.*) through the public ops: forward and backward against the
// CPU reference in f32 and bf16 (odd widths, one element, large rows), determinism and argument checks. Run on a GPU;
// skipped elsewhere.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
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

using testing::expect_error_containing;
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
  expect_error_containing(
      [&] {
        ops::swiglu_forward(gpu(), y64, Tensor::zeros({2, 8}, DType::F64, cuda));
      },
      {"swiglu_forward", "gate_up", "f32 or bf16", "f64"});
  Tensor y16 = Tensor::zeros({2, 4}, DType::BF16, cuda);
  expect_error_containing(
      [&] {
        ops::swiglu_forward(gpu(), y16, Tensor::zeros({2, 8}, DType::F32, cuda));
      },
      {"swiglu_forward", "y [N, I]", "expected dtype f32", "bf16"});
  Tensor y = Tensor::zeros({2, 4}, DType::F32, cuda);
  expect_error_containing(
      [&] {
        ops::swiglu_forward(gpu(), y, Tensor::zeros({2, 8}, DType::F32));
      },
      {"swiglu_forward", "gate_up", "stream's device cuda:0", "on cpu"});
}

}  // namespace
}  // namespace moetrain
