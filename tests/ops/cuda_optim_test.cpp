// Tests for the CUDA optimizer kernels (ops/cuda/optim.*) through the public ops: AdamW bit for bit against the CPU
// over several steps (both lerp branches, with and without weight decay), sums of squares, the global norm and
// clipping against the CPU, determinism and argument checks. Run on a GPU; skipped elsewhere.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/optim.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error_containing;
using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;

// Fails with the first differing element when two host f32 tensors differ in any bit.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const std::vector<float> a = got.to_vector<float>(), b = want.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": first difference at element " << i << ": got " << a[i] << ", want " << b[i];
      return;
    }
  }
}

TEST(CudaOptim, AdamWMatchesCpuBitwiseOverSeveralSteps) {
  MT_REQUIRE_GPU();
  // Every step is one correctly rounded f32 operation on both sides, with the same f32 scalars: the same bits.
  struct Setting {
    double beta1;  // 0.9: lerp's small-weight branch (1 - b1 < 0.5); 0.3: the other one
    double weight_decay;
  };
  for (const Setting& s : {Setting{0.9, 0.0}, Setting{0.9, 0.1}, Setting{0.3, 0.01}}) {
    for (int64_t n : {int64_t(1), int64_t(1000), int64_t(100003)}) {
      SCOPED_TRACE(::testing::Message() << "beta1 " << s.beta1 << " wd " << s.weight_decay << " n " << n);
      Rng rng(81);
      Tensor p_cpu = random_tensor({n}, DType::F32, rng);
      Tensor m_cpu = Tensor::zeros({n}, DType::F32);
      Tensor v_cpu = Tensor::zeros({n}, DType::F32);
      Tensor p_gpu = on_gpu(p_cpu), m_gpu = on_gpu(m_cpu), v_gpu = on_gpu(v_cpu);
      for (int64_t step = 1; step <= 5; ++step) {
        const Tensor grad = random_tensor({n}, DType::F32, rng, 1e-2);
        const ops::AdamWParams params{3e-4, s.beta1, 0.95, 1e-8, s.weight_decay, step};
        ops::adamw_step(Stream::cpu(), p_cpu, m_cpu, v_cpu, grad, params);
        ops::adamw_step(gpu(), p_gpu, m_gpu, v_gpu, on_gpu(grad), params);
      }
      expect_same_bits(on_cpu(p_gpu), p_cpu, "param");
      expect_same_bits(on_cpu(m_gpu), m_cpu, "exp_avg");
      expect_same_bits(on_cpu(v_gpu), v_cpu, "exp_avg_sq");
    }
  }
}

TEST(CudaOptim, SumOfSquaresMatchesCpuAndRepeatsExactly) {
  MT_REQUIRE_GPU();
  // f32 squares are exact in f64; only the summation order differs (ascending vs two fixed trees), each addition
  // erring by 1.1e-16 relative: 1e-12 is far above that and far below any real error.
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(4095), int64_t(4096), int64_t(4097), int64_t(1000003)}) {
    SCOPED_TRACE(n);
    Rng rng(82);
    const Tensor x = random_tensor({n}, DType::F32, rng);
    const double want = ops::sum_of_squares(Stream::cpu(), x);
    const Tensor xg = on_gpu(x);
    const double got = ops::sum_of_squares(gpu(), xg);
    EXPECT_NEAR(got, want, 1e-12 * want);
    EXPECT_EQ(ops::sum_of_squares(gpu(), xg), got) << "second run";
  }
}

TEST(CudaOptim, GlobalNormAndClippingMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(83);
  std::vector<Tensor> cpu_grads;
  for (const Shape& shape : {Shape{1000, 64}, Shape{7}, Shape{0}, Shape{4096, 3}, Shape{100003}}) {
    cpu_grads.push_back(random_tensor(shape, DType::F32, rng, 0.1));
  }
  std::vector<Tensor> gpu_grads;
  for (const Tensor& g : cpu_grads) gpu_grads.push_back(on_gpu(g));
  const double want = ops::global_norm(Stream::cpu(), cpu_grads);
  const double got = ops::global_norm(gpu(), gpu_grads);
  EXPECT_NEAR(got, want, 1e-12 * want);

  // No clip: the gradients keep their bits.
  EXPECT_NEAR(ops::clip_by_global_norm(gpu(), gpu_grads, 10.0 * want), want, 1e-12 * want);
  for (size_t i = 0; i < cpu_grads.size(); ++i) expect_same_bits(on_cpu(gpu_grads[i]), cpu_grads[i], "unclipped");

  // A clip to a quarter: the coefficient comes from norms equal to ~1e-15 relative, so its f32 rounding may differ
  // by one ulp: the scaled values agree to 1e-7 relative (1e-6 with the product's own rounding).
  const double norm_cpu = ops::clip_by_global_norm(Stream::cpu(), cpu_grads, 0.25 * want);
  const double norm_gpu = ops::clip_by_global_norm(gpu(), gpu_grads, 0.25 * want);
  EXPECT_NEAR(norm_gpu, norm_cpu, 1e-12 * norm_cpu);
  for (size_t i = 0; i < cpu_grads.size(); ++i) {
    EXPECT_LT(relative_error(on_cpu(gpu_grads[i]), cpu_grads[i]), 1e-6) << "grads[" << i << "]";
  }
  EXPECT_NEAR(ops::global_norm(gpu(), gpu_grads), 0.25 * want, 1e-6 * want);
}

TEST(CudaOptim, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor p16 = Tensor::zeros({4}, DType::BF16, cuda);
  expect_error_containing([&] { ops::adamw_step(gpu(), p16, p16, p16, p16, ops::AdamWParams{}); },
                          {"adamw_step", "param", "f32", "bf16"});
  Tensor p = Tensor::zeros({4}, DType::F32, cuda);
  Tensor host = Tensor::zeros({4}, DType::F32);
  expect_error_containing([&] { ops::adamw_step(gpu(), p, p, p, host, ops::AdamWParams{}); },
                          {"adamw_step", "grad", "stream's device cuda:0", "on cpu"});
  expect_error_containing(
      [&] {
        ops::global_norm(gpu(), {p, host});
      },
      {"global_norm", "tensors[1]", "stream's device cuda:0", "on cpu"});
  expect_error_containing([&] { ops::sum_of_squares(gpu(), Tensor::zeros({4}, DType::F64, cuda)); },
                          {"sum_of_squares", "x", "f32", "f64"});
}

}  // namespace
}  // namespace moetrain
