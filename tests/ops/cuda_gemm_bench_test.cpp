// Kernel benchmark of the dense GEMMs (cuBLASLt, bf16 operands, f32 accumulation) on the workload of
// record's shapes against the ceiling of docs/design.md section 7 (800 TFLOP/s bf16 at 8192^3). DISABLED_
// so it never runs as a test; run it with --gtest_also_run_disabled_tests --gtest_filter='CudaGemmBench.*'.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/gemm.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/gemm.h"
#include "ops/cuda/runtime.h"
#endif

namespace moetrain {
namespace {

#if MOETRAIN_HAS_CUDA

struct GemmShape {
  const char* name;
  int64_t m, n, k;
  ops::Transpose ta, tb;
  DType out;
};

// Seconds per call of `call` over `calls` calls on `s`, timed with CUDA events.
template <typename F>
double seconds_per_call(Stream& s, int calls, F&& call) {
  const auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(s));
  cudaEvent_t start, stop;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
  for (int i = 0; i < calls; ++i) call();
  EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(ms) * 1e-3 / calls;
}

// Seconds per call of out = op(a) op(b), mean of 20 after 3 warm-ups.
double time_gemm(const GemmShape& g) {
  const Device gpu = Device::cuda(0);
  const bool ta = g.ta == ops::Transpose::Yes, tb = g.tb == ops::Transpose::Yes;
  Tensor a = Tensor::zeros(ta ? Shape{g.k, g.m} : Shape{g.m, g.k}, DType::BF16, gpu);
  Tensor b = Tensor::zeros(tb ? Shape{g.n, g.k} : Shape{g.k, g.n}, DType::BF16, gpu);
  Tensor out = Tensor::zeros({g.m, g.n}, g.out, gpu);
  Stream& s = default_stream(gpu);
  auto call = [&] { ops::gemm(s, out, a, g.ta, b, g.tb); };
  seconds_per_call(s, 3, call);
  return seconds_per_call(s, 20, call);
}

TEST(CudaGemmBench, DISABLED_WorkloadShapes) {
  MT_REQUIRE_GPU();
  using ops::Transpose;
  // T = 8192 tokens of a micro-batch; H 2048, V 151936, q 4096, kv 512: the head and the attention projections,
  // forward (x W^T), input gradient (dy W) and weight gradient (dy^T x, f32 out).
  const GemmShape shapes[] = {
      {"square 8192^3", 8192, 8192, 8192, Transpose::No, Transpose::No, DType::BF16},
      {"head fwd", 8192, 151936, 2048, Transpose::No, Transpose::Yes, DType::BF16},
      {"head dgrad", 8192, 2048, 151936, Transpose::No, Transpose::No, DType::BF16},
      {"head wgrad f32", 151936, 2048, 8192, Transpose::Yes, Transpose::No, DType::F32},
      {"q_proj fwd", 8192, 4096, 2048, Transpose::No, Transpose::Yes, DType::BF16},
      {"o_proj fwd", 8192, 2048, 4096, Transpose::No, Transpose::Yes, DType::BF16},
      {"k_proj fwd", 8192, 512, 2048, Transpose::No, Transpose::Yes, DType::BF16},
  };
  for (const GemmShape& g : shapes) {
    const double seconds = time_gemm(g);
    const double tflops = 2.0 * double(g.m) * double(g.n) * double(g.k) / seconds / 1e12;
    std::printf("gemm %-16s M %6lld N %6lld K %6lld: %7.3f ms %6.1f TFLOP/s (%.0f%% of the 800 ceiling)\n", g.name,
                static_cast<long long>(g.m), static_cast<long long>(g.n), static_cast<long long>(g.k), seconds * 1e3,
                tflops, 100.0 * tflops / 800.0);
  }
}

// Seconds per call of `call` over enough calls to fill ~0.25 s (the step runs at the power limit, which a few
// milliseconds of work never reach), after 3 warm-ups and 3 calls that estimate the count.
template <typename F>
double time_calls(Stream& s, F&& call) {
  seconds_per_call(s, 3, call);
  const double estimate = seconds_per_call(s, 3, call);
  return seconds_per_call(s, std::clamp(static_cast<int>(0.25 / std::max(estimate, 1e-6)), 10, 5000), call);
}

// A bf16 tensor on the GPU of N(0, 1) values: a random block of 2^20 made on the CPU, repeated.
Tensor random_on_gpu(const Shape& shape, uint64_t seed) {
  Rng rng(seed);
  Tensor out = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  const int64_t block = std::min<int64_t>(out.numel(), int64_t{1} << 20);
  const Tensor pattern = testing::random_tensor({block}, DType::F32, rng).to(DType::BF16).to(Device::cuda(0));
  for (int64_t begin = 0; begin < out.numel(); begin += block) {
    const int64_t count = std::min(block, out.numel() - begin);
    EXPECT_EQ(cudaMemcpy(static_cast<uint16_t*>(out.raw_data()) + begin, pattern.raw_data(),
                         static_cast<size_t>(count) * 2, cudaMemcpyDeviceToDevice),
              cudaSuccess);
  }
  return out;
}

// Every algorithm among cuBLASLt's heuristic's first eight for the workload's GEMMs, timed in turn (twice, the second
// pass in reverse order, so that a drifting clock favours none), against the first: whether the heuristic's choice
// leaves time on the table.
TEST(CudaGemmBench, DISABLED_HeuristicAlternatives) {
  MT_REQUIRE_GPU();
  using ops::Transpose;
  struct Case {
    GemmShape shape;
    double beta;
  };
  const Case cases[] = {
      {{"head fwd", 8192, 151936, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"head dgrad", 8192, 2048, 151936, Transpose::No, Transpose::No, DType::BF16}, 0.0},
      {{"head wgrad f32 +=", 151936, 2048, 8192, Transpose::Yes, Transpose::No, DType::F32}, 1.0},
      {{"q_proj fwd", 8192, 4096, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"q_proj dgrad", 8192, 2048, 4096, Transpose::No, Transpose::No, DType::BF16}, 0.0},
      {{"q_proj wgrad f32 +=", 4096, 2048, 8192, Transpose::Yes, Transpose::No, DType::F32}, 1.0},
      {{"o_proj fwd", 8192, 2048, 4096, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"k_proj fwd", 8192, 512, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      // DeepSeek-V2-Lite (4,096 tokens a micro-batch): the head, the dense layer's MLP, the shared experts.
      {{"dsv2 head fwd", 4096, 102400, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"dsv2 head dgrad", 4096, 2048, 102400, Transpose::No, Transpose::No, DType::BF16}, 0.0},
      {{"dsv2 head wgrad f32 +=", 102400, 2048, 4096, Transpose::Yes, Transpose::No, DType::F32}, 1.0},
      {{"dsv2 mlp gate_up fwd", 4096, 21888, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"dsv2 mlp down fwd", 4096, 2048, 10944, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
      {{"dsv2 shared gate_up fwd", 4096, 5632, 2048, Transpose::No, Transpose::Yes, DType::BF16}, 0.0},
  };
  const Device gpu = Device::cuda(0);
  Stream& s = default_stream(gpu);
  for (const Case& c : cases) {
    const GemmShape& g = c.shape;
    const bool ta = g.ta == Transpose::Yes, tb = g.tb == Transpose::Yes;
    // Random-looking operands: zeros would draw less power than the step's data.
    const Tensor a = random_on_gpu(ta ? Shape{g.k, g.m} : Shape{g.m, g.k}, 1);
    const Tensor b = random_on_gpu(tb ? Shape{g.n, g.k} : Shape{g.k, g.n}, 2);
    Tensor out = Tensor::zeros({g.m, g.n}, g.out, gpu);
    const ops::cuda::GemmAlternatives alternatives(out, a, g.ta, b, g.tb, c.beta, 8);
    const int n = alternatives.count();
    std::vector<double> seconds(static_cast<size_t>(n), 0.0);
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < n; ++j) {
        const int i = pass == 0 ? j : n - 1 - j;
        seconds[static_cast<size_t>(i)] += 0.5 * time_calls(s, [&] { alternatives.run(s, i, 1.0, c.beta); });
      }
    }
    const double flop = 2.0 * double(g.m) * double(g.n) * double(g.k);
    std::printf("gemm %s M %lld N %lld K %lld, %d algorithms:\n", g.name, static_cast<long long>(g.m),
                static_cast<long long>(g.n), static_cast<long long>(g.k), n);
    for (int i = 0; i < n; ++i) {
      const double t = seconds[static_cast<size_t>(i)];
      std::printf("  #%d %8.3f ms %6.1f TFLOP/s %5.3fx of #0  %s\n", i, t * 1e3, flop / t / 1e12, seconds[0] / t,
                  alternatives.describe(i).c_str());
    }
  }
}

#endif

}  // namespace
}  // namespace moetrain
