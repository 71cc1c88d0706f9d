// Tests for the CUDA rope kernel (ops/cuda/rope.*) through the public ops: forward and backward against the CPU
// reference for rotate-half and interleaved pairs, full and partial rotary (from the head's first dim or inside it),
// attention scaling, large positions, f32 and bf16; the backward inverting the forward, in-place use, determinism
// and argument checks. Run on a GPU; skipped elsewhere.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/rope.h"
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

// The angle is the same f32 product on both sides; the CPU rounds double cos / sin to f32 (within 0.5 ulp), the GPU
// takes cosf / sinf (within 2 ulp): c and s differ by at most ~2.5 ulp (1.5e-7 relative), and each output is
// a*c -/+ b*s, so 1e-6 bounds the relative error with room for the two roundings of the products.
constexpr double kF32Tolerance = 1e-6;
// bf16 outputs are the f32 result rounded to 8 significant bits: up to 2^-9 = 2e-3 relative per element.
constexpr double kBf16Tolerance = 1e-2;

struct Case {
  Shape shape;  // [T, heads, hd]
  int rotary_dim;
  bool interleaved;
  float scaling;
  int first = 0;  // first_rotated_dim
};

const std::vector<Case> kCases = {{{37, 4, 64}, 64, false, 1.0f},      {{37, 4, 64}, 64, true, 1.0f},
                                  {{5, 2, 128}, 64, false, 1.0f},      {{5, 2, 128}, 32, true, 1.3f},
                                  {{1, 1, 2}, 2, false, 1.0f},         {{300, 8, 128}, 128, false, 0.9f},
                                  {{3, 16, 256}, 192, true, 1.0f},     {{0, 4, 64}, 64, false, 1.0f},
                                  {{37, 4, 192}, 64, true, 1.0f, 128}, {{5, 2, 128}, 32, false, 1.3f, 40}};

// Positions restart per packed document; some are large (long contexts), where the angle reaches ~1e5 radians.
Tensor make_positions(int64_t tokens, Rng& rng) {
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  int32_t next = 0;
  for (auto& p : positions) {
    if (rng.uniform() < 0.05) next = static_cast<int32_t>(rng.below(131072));
    p = next++;
  }
  return Tensor::from_vector(positions, {tokens});
}

ops::RopeParams params_of(const Case& c) {
  ops::RopeParams params = ops::rope_default_params(c.rotary_dim, 1e6);
  params.interleaved = c.interleaved;
  params.attention_scaling = c.scaling;
  params.first_rotated_dim = c.first;
  return params;
}

TEST(CudaRope, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << shape_str(c.shape) << " rotary " << c.rotary_dim
                                      << (c.interleaved ? " interleaved" : " rotate-half") << " scaling " << c.scaling
                                      << " from dim " << c.first);
    Rng rng(51);
    const ops::RopeParams params = params_of(c);
    const Tensor x = random_tensor(c.shape, DType::F32, rng);
    const Tensor positions = make_positions(c.shape[0], rng);
    for (bool backward : {false, true}) {
      Tensor want = Tensor::empty(c.shape, DType::F32);
      Tensor got = Tensor::empty(c.shape, DType::F32, Device::cuda(0));
      if (backward) {
        ops::rope_backward(Stream::cpu(), want, x, positions, params);
        ops::rope_backward(gpu(), got, on_gpu(x), on_gpu(positions), params);
      } else {
        ops::rope_forward(Stream::cpu(), want, x, positions, params);
        ops::rope_forward(gpu(), got, on_gpu(x), on_gpu(positions), params);
      }
      const double error = relative_error(host_f32(got), want);
      EXPECT_LT(error, kF32Tolerance) << (backward ? "backward" : "forward");
      std::printf("rope %s %s: rel err %.2e\n", backward ? "backward" : "forward", shape_str(c.shape).c_str(), error);
      // Dims outside the rotation are copied: exactly the input.
      if (c.rotary_dim < c.shape[2] && c.shape[0] > 0) {
        const std::vector<float> in = x.to_vector<float>(), out = host_f32(got).to_vector<float>();
        for (size_t i = 0; i < in.size(); ++i) {
          const int64_t dim = static_cast<int64_t>(i) % c.shape[2];
          if (dim < c.first || dim >= c.first + c.rotary_dim) {
            ASSERT_EQ(out[i], in[i]) << "element " << i;
          }
        }
      }
    }
  }
}

// YaRN's frequencies and attention factor (ops::rope_yarn_params) through the same kernels: DeepSeek-V2's shape
// (64 interleaved rope dims of 192, factor 40, mscale 1 / mscale_all_dim 0.8 so the cos / sin factor is not 1) and
// GPT-OSS's (64 rotate-half dims, factor 32, truncate off), at long-context positions.
TEST(CudaRope, YarnMatchesCpu) {
  MT_REQUIRE_GPU();
  ops::YarnOptions deepseek;
  deepseek.factor = 40;
  deepseek.original_max_position_embeddings = 4096;
  deepseek.mscale = 1.0;
  deepseek.mscale_all_dim = 0.8;
  ops::YarnOptions gpt_oss;
  gpt_oss.factor = 32;
  gpt_oss.original_max_position_embeddings = 4096;
  gpt_oss.truncate = false;
  struct YarnCase {
    Shape shape;
    ops::RopeParams params;
  };
  ops::RopeParams ds = ops::rope_yarn_params(64, 10000.0, deepseek);
  ds.interleaved = true;
  const std::vector<YarnCase> cases = {{{300, 16, 192}, ds},
                                       {{300, 8, 64}, ops::rope_yarn_params(64, 150000.0, gpt_oss)}};
  for (const YarnCase& c : cases) {
    Rng rng(61);
    const Tensor x = random_tensor(c.shape, DType::F32, rng);
    const Tensor positions = make_positions(c.shape[0], rng);
    for (bool backward : {false, true}) {
      Tensor want = Tensor::empty(c.shape, DType::F32);
      Tensor got = Tensor::empty(c.shape, DType::F32, Device::cuda(0));
      if (backward) {
        ops::rope_backward(Stream::cpu(), want, x, positions, c.params);
        ops::rope_backward(gpu(), got, on_gpu(x), on_gpu(positions), c.params);
      } else {
        ops::rope_forward(Stream::cpu(), want, x, positions, c.params);
        ops::rope_forward(gpu(), got, on_gpu(x), on_gpu(positions), c.params);
      }
      EXPECT_LT(relative_error(host_f32(got), want), kF32Tolerance)
          << shape_str(c.shape) << (backward ? " backward" : " forward");
    }
  }
}

TEST(CudaRope, Bf16MatchesCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << shape_str(c.shape) << " rotary " << c.rotary_dim
                                      << (c.interleaved ? " interleaved" : " rotate-half"));
    Rng rng(52);
    const ops::RopeParams params = params_of(c);
    const Tensor x16 = random_tensor(c.shape, DType::F32, rng).to(DType::BF16);
    const Tensor positions = make_positions(c.shape[0], rng);
    Tensor want = Tensor::empty(c.shape, DType::F32);
    ops::rope_forward(Stream::cpu(), want, x16.to(DType::F32), positions, params);
    Tensor got = Tensor::empty(c.shape, DType::BF16, Device::cuda(0));
    ops::rope_forward(gpu(), got, on_gpu(x16), on_gpu(positions), params);
    EXPECT_LT(relative_error(host_f32(got), want), kBf16Tolerance);
  }
}

TEST(CudaRope, BackwardInvertsForward) {
  MT_REQUIRE_GPU();
  // With scaling 1 the rotation is orthogonal: backward(forward(x)) = x up to the f32 roundings of both (1e-6).
  Rng rng(53);
  const Case c{{64, 8, 128}, 96, false, 1.0f};
  const ops::RopeParams params = params_of(c);
  const Tensor x = random_tensor(c.shape, DType::F32, rng);
  const Tensor positions = on_gpu(make_positions(64, rng));
  Tensor y = Tensor::empty(c.shape, DType::F32, Device::cuda(0));
  ops::rope_forward(gpu(), y, on_gpu(x), positions, params);
  Tensor back = Tensor::empty(c.shape, DType::F32, Device::cuda(0));
  ops::rope_backward(gpu(), back, y, positions, params);
  EXPECT_LT(relative_error(host_f32(back), x), kF32Tolerance);
}

TEST(CudaRope, InPlaceGivesTheSameBitsAndRepeatsExactly) {
  MT_REQUIRE_GPU();
  // Partial rotations too, from the head's first dim and from inside it: in place the other dims are not written.
  for (const Case& c : {Case{{128, 4, 128}, 64, false, 1.0f}, Case{{128, 4, 128}, 64, true, 1.0f},
                        Case{{128, 4, 192}, 64, true, 1.0f, 128}, Case{{128, 4, 128}, 32, false, 1.0f, 16}}) {
    SCOPED_TRACE(::testing::Message() << shape_str(c.shape) << " rotary " << c.rotary_dim << " from dim " << c.first);
    Rng rng(54);
    const ops::RopeParams params = params_of(c);
    const Tensor x = on_gpu(random_tensor(c.shape, DType::F32, rng).to(DType::BF16));
    const Tensor positions = on_gpu(make_positions(128, rng));
    Tensor first = Tensor::empty(c.shape, DType::BF16, Device::cuda(0));
    Tensor second = Tensor::empty(c.shape, DType::BF16, Device::cuda(0));
    ops::rope_forward(gpu(), first, x, positions, params);
    ops::rope_forward(gpu(), second, x, positions, params);
    EXPECT_TRUE(same_bytes(first, second)) << "repeat";
    Tensor in_place = Tensor::empty(c.shape, DType::BF16, Device::cuda(0));
    in_place.copy_from(x);
    ops::rope_forward(gpu(), in_place, in_place, positions, params);
    EXPECT_TRUE(same_bytes(in_place, first)) << "y aliasing x";
  }
}

TEST(CudaRope, RejectsWhatTheCudaKernelCannotTake) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  const Tensor positions = Tensor::zeros({2}, DType::I32, cuda);
  // 260 frequencies: more than the kernel's parameter space carries.
  const ops::RopeParams wide = ops::rope_default_params(520, 1e4);
  Tensor y = Tensor::zeros({2, 1, 520}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::rope_forward(gpu(), y, Tensor::zeros({2, 1, 520}, DType::F32, cuda), positions, wide);
      },
      {"rope_forward", "at most 256 frequencies", "520"});
  const ops::RopeParams params = ops::rope_default_params(8, 1e4);
  Tensor y64 = Tensor::zeros({2, 1, 8}, DType::F64, cuda);
  expect_error(
      [&] {
        ops::rope_forward(gpu(), y64, Tensor::zeros({2, 1, 8}, DType::F64, cuda), positions, params);
      },
      {"rope_forward", "x", "f32 or bf16", "f64"});
  Tensor y8 = Tensor::zeros({2, 1, 8}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::rope_forward(gpu(), y8, Tensor::zeros({2, 1, 8}, DType::F32, cuda), Tensor::zeros({2}, DType::I32),
                          params);
      },
      {"rope_forward", "position_ids", "stream's device cuda:0", "on cpu"});
}

}  // namespace
}  // namespace moetrain
