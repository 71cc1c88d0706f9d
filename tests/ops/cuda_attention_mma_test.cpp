// Tests for the tensor-core attention kernels (ops/cuda/attention_mma.*) through the public ops, bf16 at head dims
// 64 and 128: a document's rows of out, lse, dq, dk, dv keep their bytes whatever is packed around it (tiles at
// document starts); and, as a disabled benchmark, forward + backward at the Qwen3-30B-A3B attention shape against
// cuDNN's.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ops/attention.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/attention_mma.h"
#endif
#include "ops/cuda/runtime.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::gpu;
using testing::on_gpu;
using testing::random_tensor;

struct Grads {
  Tensor out, lse, dq, dk, dv;  // on the host
};

Grads run_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const std::vector<int32_t>& cu,
               const ops::AttentionParams& params) {
  const int64_t T = q.size(0), nh = q.size(1), nkv = k.size(1), hd = q.size(2);
  const Device dev = Device::cuda(0);
  const Tensor qd = on_gpu(q), kd = on_gpu(k), vd = on_gpu(v), dod = on_gpu(dout);
  const Tensor cud = on_gpu(Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}));
  Tensor out = Tensor::empty({T, nh, hd}, DType::BF16, dev), lse = Tensor::empty({T, nh}, DType::F32, dev);
  Tensor dq = Tensor::empty({T, nh, hd}, DType::BF16, dev), dk = Tensor::empty({T, nkv, hd}, DType::BF16, dev);
  Tensor dv = Tensor::empty({T, nkv, hd}, DType::BF16, dev);
  ops::attention_forward(gpu(), out, lse, qd, kd, vd, cud, params);
  ops::attention_backward(gpu(), dq, dk, dv, dod, qd, kd, vd, out, lse, cud, params);
  const auto back = [](const Tensor& t) { return t.to(Device::cpu()); };
  return {back(out), back(lse), back(dq), back(dk), back(dv)};
}

using testing::same_bytes;

#if MOETRAIN_HAS_CUDA
TEST(CudaAttentionMma, TakesBf16AtHeadDims64And128Only) {
  EXPECT_TRUE(ops::cuda::mma_attention_supported(DType::BF16, 64, 64));
  EXPECT_TRUE(ops::cuda::mma_attention_supported(DType::BF16, 128, 128));
  EXPECT_FALSE(ops::cuda::mma_attention_supported(DType::F32, 128, 128));
  EXPECT_FALSE(ops::cuda::mma_attention_supported(DType::BF16, 192, 128));
  EXPECT_FALSE(ops::cuda::mma_attention_supported(DType::BF16, 96, 96));
}
#endif

TEST(CudaAttentionMma, Bf16DocumentRowsAreBitwiseIndependentOfPacking) {
  MT_REQUIRE_GPU();
  // Document A (300 tokens) alone, then packed at offset 37 between two other documents.
  const int64_t nh = 8, nkv = 2, len = 300, before = 37, after = 63;
  for (const int64_t hd : {64, 128}) {
    for (const int window : {0, 50}) {
      SCOPED_TRACE("hd " + std::to_string(hd) + " window " + std::to_string(window));
      ops::AttentionParams params;
      params.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
      params.sliding_window = window;
      Rng rng(static_cast<uint64_t>(700 + hd + window));
      const int64_t T = before + len + after;
      const Tensor q = random_tensor({T, nh, hd}, DType::F32, rng).to(DType::BF16);
      const Tensor k = random_tensor({T, nkv, hd}, DType::F32, rng).to(DType::BF16);
      const Tensor v = random_tensor({T, nkv, hd}, DType::F32, rng).to(DType::BF16);
      const Tensor dout = random_tensor({T, nh, hd}, DType::F32, rng).to(DType::BF16);
      const Grads packed = run_bf16(q, k, v, dout, {0, 37, 337, 400}, params);
      const auto doc = [&](const Tensor& t) { return t.slice(before, before + len); };
      const Grads alone = run_bf16(doc(q), doc(k), doc(v), doc(dout), {0, static_cast<int32_t>(len)}, params);
      EXPECT_TRUE(same_bytes(alone.out, doc(packed.out))) << "out";
      EXPECT_TRUE(same_bytes(alone.lse, doc(packed.lse))) << "lse";
      EXPECT_TRUE(same_bytes(alone.dq, doc(packed.dq))) << "dq";
      EXPECT_TRUE(same_bytes(alone.dk, doc(packed.dk))) << "dk";
      EXPECT_TRUE(same_bytes(alone.dv, doc(packed.dv))) << "dv";
    }
  }
}

// A benchmark, not a check (DISABLED_: run with --gtest_also_run_disabled_tests
// --gtest_filter='CudaAttentionMmaBench.*'): the time of forward + backward over 4 documents of 4096 tokens (32 query
// heads, 4 kv heads, hd 128, causal; a quarter of the 65,536-token step of record) for our kernels and, for comparison,
// cuDNN's.
TEST(CudaAttentionMmaBench, DISABLED_WorkloadShape) {
  MT_REQUIRE_GPU();
  const int64_t docs = 4, len = 4096, T = docs * len, nh = 32, nkv = 4, hd = 128;
  Rng rng(900);
  const Device dev = Device::cuda(0);
  const Tensor q = on_gpu(random_tensor({T, nh, hd}, DType::F32, rng).to(DType::BF16));
  const Tensor k = on_gpu(random_tensor({T, nkv, hd}, DType::F32, rng).to(DType::BF16));
  const Tensor v = on_gpu(random_tensor({T, nkv, hd}, DType::F32, rng).to(DType::BF16));
  const Tensor dout = on_gpu(random_tensor({T, nh, hd}, DType::F32, rng).to(DType::BF16));
  std::vector<int32_t> cu_values;
  for (int64_t d = 0; d <= docs; ++d) cu_values.push_back(static_cast<int32_t>(d * len));
  const Tensor cu = on_gpu(Tensor::from_vector(cu_values, {docs + 1}));
  Tensor out = Tensor::empty({T, nh, hd}, DType::BF16, dev), lse = Tensor::empty({T, nh}, DType::F32, dev);
  Tensor dq = Tensor::empty({T, nh, hd}, DType::BF16, dev), dk = Tensor::empty({T, nkv, hd}, DType::BF16, dev);
  Tensor dv = Tensor::empty({T, nkv, hd}, DType::BF16, dev);
  const double fwd_flops = 4.0 * static_cast<double>(docs) * (static_cast<double>(len) * len / 2) * nh * hd;
  for (const int64_t max_seqlen : {int64_t{0}, len}) {
    ops::AttentionParams params;
    params.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    params.max_seqlen = max_seqlen;  // 0: our kernels; known: cuDNN where it takes the arguments
    const auto time_ms = [&](bool backward, int reps) {
      ops::cuda::synchronize(dev);
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) {
        if (backward) {
          ops::attention_backward(gpu(), dq, dk, dv, dout, q, k, v, out, lse, cu, params);
        } else {
          ops::attention_forward(gpu(), out, lse, q, k, v, cu, params);
        }
      }
      ops::cuda::synchronize(dev);
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
    };
    time_ms(false, 1);
    time_ms(true, 1);
    const double fwd = time_ms(false, 5), bwd = time_ms(true, 5);
    std::printf(
        "[attention %s] T %lld: forward %.3f ms (%.1f TFLOP/s), backward %.3f ms (%.1f TFLOP/s); "
        "x%lld for 65,536 tokens: %.1f ms per step\n",
        max_seqlen == 0 ? "ours" : "cudnn", static_cast<long long>(T), fwd, fwd_flops / fwd / 1e9, bwd,
        2.5 * fwd_flops / bwd / 1e9, static_cast<long long>(65536 / T), (fwd + bwd) * (65536.0 / T));
  }
}

}  // namespace
}  // namespace moetrain
