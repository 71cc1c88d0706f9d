// Kernel benchmark of the dense GEMMs (cuBLASLt, bf16 operands, f32 accumulation) on the workload of
// record's shapes against the ceiling of docs/design.md section 7 (800 TFLOP/s bf16 at 8192^3). DISABLED_
// so it never runs as a test; run it with --gtest_also_run_disabled_tests --gtest_filter='CudaGemmBench.*'.
#include <cstdio>

#include <gtest/gtest.h>

#include "ops/gemm.h"
#include "testing/gpu.h"

#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>

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

// Seconds per call of out = op(a) op(b), mean of 20 after 3 warm-ups, timed with CUDA events.
double time_gemm(const GemmShape& g) {
  const Device gpu = Device::cuda(0);
  const bool ta = g.ta == ops::Transpose::Yes, tb = g.tb == ops::Transpose::Yes;
  Tensor a = Tensor::zeros(ta ? Shape{g.k, g.m} : Shape{g.m, g.k}, DType::BF16, gpu);
  Tensor b = Tensor::zeros(tb ? Shape{g.n, g.k} : Shape{g.k, g.n}, DType::BF16, gpu);
  Tensor out = Tensor::zeros({g.m, g.n}, g.out, gpu);
  Stream& s = default_stream(gpu);
  for (int i = 0; i < 3; ++i) ops::gemm(s, out, a, g.ta, b, g.tb);
  cudaEvent_t start, stop;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  const auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(s));
  EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
  constexpr int kIterations = 20;
  for (int i = 0; i < kIterations; ++i) ops::gemm(s, out, a, g.ta, b, g.tb);
  EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(ms) * 1e-3 / kIterations;
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

#endif

}  // namespace
}  // namespace moetrain
