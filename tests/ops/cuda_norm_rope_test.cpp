// Tests for the CUDA ops that fold one op's work into another's pass: the q/k norm + rope kernels
// (ops/cuda/norm_rope.*) against the CUDA norm then rope kernels (bitwise: fused row widths 64, 128 and 256, and the
// shapes that run the two kernels) and against the CPU, in place, batch invariance of a row; the norm's input gradient
// with the residual's gradient added (bitwise the input gradient then accumulate); and the input gradient added into dx
// by its GEMM (against the CPU, and bitwise the two ops under the exact lanes' policy in bf16). Run on a GPU; skipped
// elsewhere.
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/norm_rope.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;
using testing::same_bytes;

struct Case {
  Shape shape;  // [T, heads, hd]
  int rotary_dim;
  bool interleaved;
};

// hd 64, 128 and 256 over the whole head run the one kernel; partial rotary, interleaved pairs and hd 96 the two.
const std::vector<Case> kCases = {{{37, 4, 64}, 64, false},  {{300, 8, 128}, 128, false}, {{9, 3, 256}, 256, false},
                                  {{1, 1, 128}, 128, false}, {{37, 4, 64}, 32, false},    {{37, 4, 64}, 64, true},
                                  {{11, 2, 96}, 96, false},  {{0, 4, 128}, 128, false}};

// Packed documents: positions restart, some far into a long context.
Tensor make_positions(int64_t tokens, Rng& rng) {
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  int32_t next = 0;
  for (auto& p : positions) {
    if (rng.uniform() < 0.1) next = rng.uniform() < 0.5 ? 0 : static_cast<int32_t>(rng.below(131072));
    p = next++;
  }
  return Tensor::from_vector(positions, {tokens});
}

ops::RopeParams params_of(const Case& c) {
  ops::RopeParams params = ops::rope_default_params(c.rotary_dim, 1e6);
  params.interleaved = c.interleaved;
  params.attention_scaling = 0.9f;
  return params;
}

struct Outputs {
  Tensor y, rstd, d_normed, dx;
};

// The fused ops (fused) or the norm and rope ops in turn, on `stream`'s device, from tensors there.
Outputs run(Stream& stream, bool fused, const Tensor& x, const Tensor& w, const Tensor& d_rotated,
            const Tensor& positions, const ops::RmsNormParams& norm, const ops::RopeParams& rope) {
  const Device dev = x.device();
  Outputs out;
  out.y = Tensor::empty(x.shape(), x.dtype(), dev);
  out.rstd = Tensor::empty({x.size(0) * x.size(1)}, DType::F32, dev);
  out.d_normed = Tensor::empty(x.shape(), x.dtype(), dev);
  out.dx = Tensor::empty(x.shape(), x.dtype(), dev);
  if (fused) {
    ops::rmsnorm_rope_forward(stream, out.y, out.rstd, x, w, norm, positions, rope);
    ops::rope_rmsnorm_backward_input(stream, out.dx, out.d_normed, d_rotated, x, w, out.rstd, norm, positions, rope);
  } else {
    ops::rmsnorm_forward(stream, out.y, out.rstd, x, w, norm);
    ops::rope_forward(stream, out.y, out.y, positions, rope);
    ops::rope_backward(stream, out.d_normed, d_rotated, positions, rope);
    ops::rmsnorm_backward_input(stream, out.dx, out.d_normed, x, w, out.rstd, norm);
  }
  return out;
}

TEST(CudaNormRope, GivesTheBitsOfNormThenRope) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool zero_centered : {false, true}) {
      for (const Case& c : kCases) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " " << shape_str(c.shape) << " rotary " << c.rotary_dim
                     << (c.interleaved ? " interleaved" : "") << (zero_centered ? " zero-centred" : ""));
        Rng rng(81);
        const Tensor x = on_gpu(random_tensor(c.shape, DType::F32, rng, 2.0).to(dtype));
        const Tensor w = on_gpu(random_tensor({c.shape[2]}, DType::F32, rng, 0.5));
        const Tensor d_rotated = on_gpu(random_tensor(c.shape, DType::F32, rng).to(dtype));
        const Tensor positions = on_gpu(make_positions(c.shape[0], rng));
        const ops::RmsNormParams norm{1e-6f, zero_centered};
        const ops::RopeParams rope = params_of(c);
        const Outputs got = run(gpu(), true, x, w, d_rotated, positions, norm, rope);
        const Outputs want = run(gpu(), false, x, w, d_rotated, positions, norm, rope);
        EXPECT_TRUE(same_bytes(got.y, want.y)) << "y";
        EXPECT_TRUE(same_bytes(got.rstd, want.rstd)) << "rstd";
        EXPECT_TRUE(same_bytes(got.d_normed, want.d_normed)) << "d_normed";
        EXPECT_TRUE(same_bytes(got.dx, want.dx)) << "dx";

        // d_normed over d_rotated (the attention block's use) changes nothing.
        const Tensor in_place = d_rotated.clone();
        const Tensor dx = Tensor::empty(c.shape, dtype, Device::cuda(0));
        ops::rope_rmsnorm_backward_input(gpu(), dx, in_place, in_place, x, w, got.rstd, norm, positions, rope);
        EXPECT_TRUE(same_bytes(in_place, want.d_normed)) << "d_normed in place";
        EXPECT_TRUE(same_bytes(dx, want.dx)) << "dx with d_normed in place";
      }
    }
  }
}

// f32 against the CPU: the norm's sums run in other orders and cosf / sinf are within 2 ulp of the CPU's rounded
// double values (ops/cuda/rope.h), so each output is within a few ulp: 1e-5 relative with room.
TEST(CudaNormRope, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    if (c.shape[0] == 0) continue;
    SCOPED_TRACE(::testing::Message() << shape_str(c.shape) << " rotary " << c.rotary_dim);
    Rng rng(82);
    const Tensor x = random_tensor(c.shape, DType::F32, rng, 2.0);
    const Tensor w = random_tensor({c.shape[2]}, DType::F32, rng, 0.5);
    const Tensor d_rotated = random_tensor(c.shape, DType::F32, rng);
    const Tensor positions = make_positions(c.shape[0], rng);
    const ops::RmsNormParams norm{1e-6f, false};
    const ops::RopeParams rope = params_of(c);
    const Outputs want = run(Stream::cpu(), true, x, w, d_rotated, positions, norm, rope);
    const Outputs got = run(gpu(), true, on_gpu(x), on_gpu(w), on_gpu(d_rotated), on_gpu(positions), norm, rope);
    for (const auto& [name, a, b] :
         {std::tuple{"y", got.y, want.y}, std::tuple{"rstd", got.rstd, want.rstd},
          std::tuple{"d_normed", got.d_normed, want.d_normed}, std::tuple{"dx", got.dx, want.dx}}) {
      const double error = relative_error(host_f32(a), b);
      EXPECT_LT(error, 1e-5) << name;
      std::printf("norm_rope %s %s: rel err %.2e\n", shape_str(c.shape).c_str(), name, error);
    }
  }
}

// A row's bits follow from the row alone: the first rows of a batch equal the same rows run alone.
TEST(CudaNormRope, RowResultsDoNotDependOnOtherRows) {
  MT_REQUIRE_GPU();
  Rng rng(83);
  const Shape shape{64, 8, 128};
  const Tensor x = on_gpu(random_tensor(shape, DType::F32, rng).to(DType::BF16));
  const Tensor w = on_gpu(random_tensor({128}, DType::F32, rng, 0.5));
  const Tensor d_rotated = on_gpu(random_tensor(shape, DType::F32, rng).to(DType::BF16));
  const Tensor positions = on_gpu(make_positions(64, rng));
  const ops::RopeParams rope = ops::rope_default_params(128, 1e6);
  const Outputs all = run(gpu(), true, x, w, d_rotated, positions, {}, rope);
  const Outputs part = run(gpu(), true, x.slice(0, 5).clone(), w, d_rotated.slice(0, 5).clone(),
                           positions.slice(0, 5).clone(), {}, rope);
  EXPECT_TRUE(same_bytes(part.y, all.y.slice(0, 5).clone()));
  EXPECT_TRUE(same_bytes(part.dx, all.dx.slice(0, 5).clone()));
}

TEST(CudaRmsNormBackwardInputAdd, GivesTheBitsOfTheInputGradientThenAccumulate) {
  MT_REQUIRE_GPU();
  // Widths that walk rows in spans of 8 on 8, 16 and 32 lanes, and widths that walk elements.
  const std::vector<Shape> shapes = {{300, 2048}, {5, 128}, {7, 33}, {3, 1}, {1000, 64}, {0, 64}};
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (const Shape& shape : shapes) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " " << shape_str(shape));
      Rng rng(84);
      const Tensor x = on_gpu(random_tensor(shape, DType::F32, rng, 2.0).to(dtype));
      const Tensor w = on_gpu(random_tensor({shape.back()}, DType::F32, rng, 0.5));
      const Tensor dy = on_gpu(random_tensor(shape, DType::F32, rng).to(dtype));
      const Tensor addend = on_gpu(random_tensor(shape, DType::F32, rng).to(dtype));
      const ops::RmsNormParams norm{1e-6f, true};
      const Tensor y = Tensor::empty(shape, dtype, Device::cuda(0));
      const Tensor rstd = Tensor::empty({shape[0]}, DType::F32, Device::cuda(0));
      ops::rmsnorm_forward(gpu(), y, rstd, x, w, norm);
      const Tensor got = Tensor::empty(shape, dtype, Device::cuda(0));
      ops::rmsnorm_backward_input_add(gpu(), got, dy, x, w, rstd, norm, addend);
      const Tensor want = Tensor::empty(shape, dtype, Device::cuda(0));
      ops::rmsnorm_backward_input(gpu(), want, dy, x, w, rstd, norm);
      ops::accumulate(gpu(), want, addend);
      EXPECT_TRUE(same_bytes(got, want));
    }
  }
}

// dx += dy w on cuBLASLt with beta = 1 (the sum rounded once) against the CPU's f32 on the same bf16-valued operands;
// under the exact lanes' policy with a bf16 dx, bitwise the input gradient then accumulate.
TEST(CudaLinearBackwardInputAccumulate, MatchesCpuAndTheTwoOpsUnderTheExactLanes) {
  MT_REQUIRE_GPU();
  Rng rng(85);
  const int64_t m = 512, n = 384, k = 256;
  const Tensor dy = random_tensor({m, n}, DType::F32, rng).to(DType::BF16);
  const Tensor w = random_tensor({n, k}, DType::F32, rng, 0.05).to(DType::BF16);
  const Tensor dx0 = random_tensor({m, k}, DType::F32, rng).to(DType::BF16);
  Tensor want = host_f32(dx0);
  ops::linear_backward_input_accumulate(Stream::cpu(), want, host_f32(dy), host_f32(w));
  const Tensor got = on_gpu(dx0);
  ops::linear_backward_input_accumulate(gpu(), got, on_gpu(dy), on_gpu(w));
  const double error = relative_error(host_f32(got), want);
  std::printf("linear_backward_input_accumulate bf16: rel err %.2e\n", error);
  EXPECT_LT(error, 1e-2);  // one bf16 rounding of the sum: 2^-9 relative per element at most

  gpu().hold_batch_invariant();
  const Tensor exact = on_gpu(dx0);
  ops::linear_backward_input_accumulate(gpu(), exact, on_gpu(dy), on_gpu(w));
  const Tensor two_ops = on_gpu(dx0);
  const Tensor product = Tensor::empty({m, k}, DType::BF16, Device::cuda(0));
  ops::linear_backward_input(gpu(), product, on_gpu(dy), on_gpu(w));
  ops::accumulate(gpu(), two_ops, product);
  gpu().release_batch_invariant();
  EXPECT_TRUE(same_bytes(exact, two_ops));
}

}  // namespace
}  // namespace moetrain
