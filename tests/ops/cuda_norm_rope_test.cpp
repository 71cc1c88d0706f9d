// Tests for the CUDA ops that fold one op's work into another's pass: the q/k norm + rope kernels
// (ops/cuda/norm_rope.*) against the CUDA norm, rope and norm-gradient kernels (bitwise for y, rstd and dx at fused
// row widths 64, 128 and 256 and at the shapes that run the separate kernels; dw within its summation bound, many
// rows included) and against the CPU, and a row's independence of the others; the norm's input gradient with the
// residual's gradient added (bitwise the input gradient then accumulate); and the input gradient added into dx by its
// GEMM (against the CPU, and bitwise the two ops under the exact lanes' policy in bf16). Run on a GPU; skipped
// elsewhere.
#include <cmath>
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
// 21 x 3 x 128 and 33000 x 3 x 64 leave a warp's last row set of each token part empty (2 and 4 rows a set); 33000
// tokens also make the backward's warps (at most 4,096 blocks of 8) stride over several tokens.
const std::vector<Case> kCases = {{{37, 4, 64}, 64, false},   {{300, 8, 128}, 128, false}, {{9, 3, 256}, 256, false},
                                  {{1, 1, 128}, 128, false},  {{37, 4, 64}, 32, false},    {{37, 4, 64}, 64, true},
                                  {{11, 2, 96}, 96, false},   {{0, 4, 128}, 128, false},   {{21, 3, 128}, 128, false},
                                  {{33000, 3, 64}, 64, false}};

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
  Tensor y, rstd, dx, dw;
};

// The fused ops (fused) or the norm and rope ops in turn, on `stream`'s device, from tensors there; dw starts at dw0.
Outputs run(Stream& stream, bool fused, const Tensor& x, const Tensor& w, const Tensor& d_rotated,
            const Tensor& positions, const ops::RmsNormParams& norm, const ops::RopeParams& rope, const Tensor& dw0) {
  const Device dev = x.device();
  Outputs out;
  out.y = Tensor::empty(x.shape(), x.dtype(), dev);
  out.rstd = Tensor::empty({x.size(0) * x.size(1)}, DType::F32, dev);
  out.dx = Tensor::empty(x.shape(), x.dtype(), dev);
  out.dw = dw0.to(dev);
  if (fused) {
    ops::rmsnorm_rope_forward(stream, out.y, out.rstd, x, w, norm, positions, rope);
    ops::rope_rmsnorm_backward(stream, out.dx, out.dw, d_rotated, x, w, out.rstd, norm, positions, rope);
  } else {
    const Tensor d_normed = Tensor::empty(x.shape(), x.dtype(), dev);
    ops::rmsnorm_forward(stream, out.y, out.rstd, x, w, norm);
    ops::rope_forward(stream, out.y, out.y, positions, rope);
    ops::rope_backward(stream, d_normed, d_rotated, positions, rope);
    ops::rmsnorm_backward_input(stream, out.dx, d_normed, x, w, out.rstd, norm);
    ops::rmsnorm_backward_weight(stream, out.dw, d_normed, x, out.rstd);
  }
  return out;
}

// dw against the f64 sum of the unfused path's terms (d_normed * x * rstd, from the CUDA ops' d_normed): the fused
// kernel sums the same f32 terms in another fixed order, a chain of at most (rows a lane group takes + 32 groups +
// 8 + 32 per level of add_column_sums) additions, well inside 400 u sum |terms| at these sizes.
void expect_weight_gradient_within_bound(const Tensor& got_dw, const Tensor& dw0, const Tensor& d_normed,
                                         const Tensor& x, const Tensor& rstd) {
  const Tensor dn = host_f32(d_normed), xs = host_f32(x), r = host_f32(rstd), got = host_f32(got_dw);
  const int64_t dim = dw0.numel(), rows = dn.numel() / dim;
  int64_t over = 0;
  for (int64_t d = 0; d < dim; ++d) {
    double sum = dw0.data<float>()[d], magnitude = std::fabs(sum);
    for (int64_t n = 0; n < rows; ++n) {
      const float term = dn.data<float>()[n * dim + d] * (xs.data<float>()[n * dim + d] * r.data<float>()[n]);
      sum += term;
      magnitude += std::fabs(term);
    }
    if (std::fabs(got.data<float>()[d] - sum) > 400.0 * std::ldexp(1.0, -24) * magnitude) ++over;
  }
  EXPECT_EQ(over, 0) << "columns of dw over their summation bound";
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
        const Tensor dw0 = random_tensor({c.shape[2]}, DType::F32, rng);
        const ops::RmsNormParams norm{1e-6f, zero_centered};
        const ops::RopeParams rope = params_of(c);
        const Outputs got = run(gpu(), true, x, w, d_rotated, positions, norm, rope, dw0);
        const Outputs want = run(gpu(), false, x, w, d_rotated, positions, norm, rope, dw0);
        EXPECT_TRUE(same_bytes(got.y, want.y)) << "y";
        EXPECT_TRUE(same_bytes(got.rstd, want.rstd)) << "rstd";
        EXPECT_TRUE(same_bytes(got.dx, want.dx)) << "dx";
        const Tensor d_normed = Tensor::empty(c.shape, dtype, Device::cuda(0));
        ops::rope_backward(gpu(), d_normed, d_rotated, positions, rope);
        expect_weight_gradient_within_bound(got.dw, dw0, d_normed, x, want.rstd);
        const Outputs again = run(gpu(), true, x, w, d_rotated, positions, norm, rope, dw0);
        EXPECT_TRUE(same_bytes(again.dw, got.dw)) << "dw in a second run";
      }
    }
  }
}

// Many rows: the backward's grid stops at its block limit and the warps stride over the rest (q-norm rows of the
// workload of record, 8192 tokens x 32 heads); dw over levels of block sums.
TEST(CudaNormRope, WeightGradientOfManyRowsIsWithinItsSummationBound) {
  MT_REQUIRE_GPU();
  Rng rng(86);
  const Shape shape{8192, 32, 128};
  const Tensor x = on_gpu(random_tensor(shape, DType::F32, rng).to(DType::BF16));
  const Tensor w = on_gpu(random_tensor({128}, DType::F32, rng, 0.5));
  const Tensor d_rotated = on_gpu(random_tensor(shape, DType::F32, rng).to(DType::BF16));
  const Tensor positions = on_gpu(make_positions(8192, rng));
  const Tensor dw0 = random_tensor({128}, DType::F32, rng);
  const ops::RopeParams rope = ops::rope_default_params(128, 1e6);
  const Outputs got = run(gpu(), true, x, w, d_rotated, positions, {}, rope, dw0);
  const Outputs want = run(gpu(), false, x, w, d_rotated, positions, {}, rope, dw0);
  EXPECT_TRUE(same_bytes(got.dx, want.dx)) << "dx";
  const Tensor d_normed = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  ops::rope_backward(gpu(), d_normed, d_rotated, positions, rope);
  expect_weight_gradient_within_bound(got.dw, dw0, d_normed, x, want.rstd);
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
    const Tensor dw0 = random_tensor({c.shape[2]}, DType::F32, rng);
    const ops::RmsNormParams norm{1e-6f, false};
    const ops::RopeParams rope = params_of(c);
    const Outputs want = run(Stream::cpu(), true, x, w, d_rotated, positions, norm, rope, dw0);
    const Outputs got = run(gpu(), true, on_gpu(x), on_gpu(w), on_gpu(d_rotated), on_gpu(positions), norm, rope, dw0);
    for (const auto& [name, a, b] : {std::tuple{"y", got.y, want.y}, std::tuple{"rstd", got.rstd, want.rstd},
                                     std::tuple{"dx", got.dx, want.dx}, std::tuple{"dw", got.dw, want.dw}}) {
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
  const Tensor dw0 = Tensor::zeros({128}, DType::F32);
  const ops::RopeParams rope = ops::rope_default_params(128, 1e6);
  const Outputs all = run(gpu(), true, x, w, d_rotated, positions, {}, rope, dw0);
  const Outputs part = run(gpu(), true, x.slice(0, 5).clone(), w, d_rotated.slice(0, 5).clone(),
                           positions.slice(0, 5).clone(), {}, rope, dw0);
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
