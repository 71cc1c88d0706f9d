// Tests for the cuDNN attention path (ops/cuda/attention_cudnn.*) through the public ops (bf16, hd == hdv in
// {64, 128, 256}, max_seqlen known; at 256 the backward on our kernels): forward (out, lse) and backward (dq, dk, dv)
// against the f32 CPU reference on the same bf16 values (one document, unequal documents with single-token ones,
// batches that get padded with empty documents, GQA 32/4 and 4/2, MHA, non-causal, causal sliding windows of 1, 37 and
// 128 keys), the dense graph of documents that fill their rows against the same, against our own CUDA kernels at the
// workload of record (2 x 4096 tokens, 32/4 heads, hd 128), the graph cache, the dispatch rules, the max_seqlen
// checks, and a throughput benchmark that only runs on request (--gtest_also_run_disabled_tests).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>
#include <cudnn.h>
#endif

#include "ops/attention.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/runtime.h"
#endif

namespace moetrain {
namespace {

#if MOETRAIN_HAS_CUDA

using testing::expect_error;
using testing::random_tensor;
using testing::relative_error;

Device gpu_device() { return Device::cuda(0); }

Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector<int32_t>(cu, {static_cast<int64_t>(cu.size())});
}

int64_t longest(const std::vector<int32_t>& cu) {
  int64_t m = 0;
  for (size_t i = 1; i < cu.size(); ++i) m = std::max<int64_t>(m, cu[i] - cu[i - 1]);
  return m;
}

struct Case {
  std::string name;
  int64_t nh, nkv, hd;
  std::vector<int32_t> cu;
  bool causal = true;
  int64_t max_seqlen = 0;  // 0: the longest document
  int64_t hdv = 0;         // the value head dim; 0: hd
  int window = 0;          // sliding_window (0: none)
  int64_t value_dim() const { return hdv > 0 ? hdv : hd; }
};

ops::AttentionParams params_of(const Case& c) {
  ops::AttentionParams p;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.hd)));
  p.causal = c.causal;
  p.max_seqlen = c.max_seqlen > 0 ? c.max_seqlen : longest(c.cu);
  p.sliding_window = c.window;
  return p;
}

struct Inputs {
  Tensor q, k, v, dout;  // f32 on the CPU holding bf16-representable values
};

struct Results {
  Tensor out, lse, dq, dk, dv;  // f32 on the CPU
};

Inputs random_inputs(const Case& c, uint64_t seed) {
  Rng rng(seed);
  const int64_t tokens = c.cu.back();
  Inputs in{random_tensor({tokens, c.nh, c.hd}, DType::F32, rng), random_tensor({tokens, c.nkv, c.hd}, DType::F32, rng),
            random_tensor({tokens, c.nkv, c.value_dim()}, DType::F32, rng),
            random_tensor({tokens, c.nh, c.value_dim()}, DType::F32, rng)};
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) *t = testing::rounded_to_bf16(*t);
  return in;
}

// How run_attention calls attention: through the public ops, or through the cuDNN functions themselves with the dense
// graph allowed or not (bf16 on the GPU).
enum class Route { PublicOps, CudnnRagged, CudnnDense };

// Forward then backward (reading the forward's own out and lse) on `device` in `dtype`.
Results run_attention(const Inputs& in, const Case& c, const ops::AttentionParams& params, Device device, DType dtype,
                      Route route = Route::PublicOps) {
  const auto put = [&](const Tensor& t) { return t.to(dtype).to(device); };
  const Tensor q = put(in.q), k = put(in.k), v = put(in.v), dout = put(in.dout);
  const Tensor cu = cu_tensor(c.cu).to(device);
  const int64_t tokens = c.cu.back();
  Tensor out = Tensor::empty({tokens, c.nh, c.value_dim()}, dtype, device);
  Tensor lse = Tensor::empty({tokens, c.nh}, device.is_cuda() ? DType::F32 : dtype, device);
  Tensor dq = Tensor::empty({tokens, c.nh, c.hd}, dtype, device);
  Tensor dk = Tensor::empty({tokens, c.nkv, c.hd}, dtype, device);
  Tensor dv = Tensor::empty({tokens, c.nkv, c.value_dim()}, dtype, device);
  Stream& s = default_stream(device);
  if (route == Route::PublicOps) {
    ops::attention_forward(s, out, lse, q, k, v, cu, params);
    ops::attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, params);
  } else {
    const bool dense = route == Route::CudnnDense;
    ops::cuda::cudnn_attention_forward(s, out, lse, q, k, v, cu, params, dense);
    ops::cuda::cudnn_attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, params, dense);
  }
  return {testing::host_f32(out), testing::host_f32(lse), testing::host_f32(dq), testing::host_f32(dk),
          testing::host_f32(dv)};
}

// ||t|| of a host f32 tensor.
double l2_norm(const Tensor& t) {
  double sum = 0.0;
  for (float x : t.to_vector<float>()) sum += double(x) * double(x);
  return std::sqrt(sum);
}

void expect_close(const Results& got, const Results& want, double threshold, const std::string& what) {
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> pairs[] = {{"out", {&got.out, &want.out}},
                                                                                   {"lse", {&got.lse, &want.lse}},
                                                                                   {"dq", {&got.dq, &want.dq}},
                                                                                   {"dk", {&got.dk, &want.dk}},
                                                                                   {"dv", {&got.dv, &want.dv}}};
  for (const auto& [name, t] : pairs) {
    // A window of 1 makes each softmax a single 1, whose dq and dk are exactly 0: those are measured against the size
    // of dv, the gradient the same dout drives (bf16 leaves ~1e-6 there, from D = dout . out on the rounded out).
    const double err =
        l2_norm(*t.second) == 0.0 ? l2_norm(*t.first) / l2_norm(want.dv) : relative_error(*t.first, *t.second);
    EXPECT_LT(err, threshold) << what << ": " << name << " relative error ||gpu - ref|| / ||ref|| = " << err
                              << " (max abs diff " << testing::max_abs_diff(*t.first, *t.second) << ")";
    std::printf("[ cuDNN    ] %s: %s relative error %.3e\n", what.c_str(), name, err);
  }
}

std::vector<Case> reference_cases() {
  // Single-token documents, documents across 64 / 128-row tiles, a short tail; 6 documents are padded to a batch
  // of 8 and 3 documents to 4 (empty documents at the end).
  const std::vector<int32_t> mixed = {0, 1, 2, 67, 68, 368, 400};
  return {
      {"one_document_gqa32_4_hd128", 32, 4, 128, {0, 300}},
      {"mixed_documents_gqa4_2_hd64", 4, 2, 64, mixed},
      {"mixed_documents_gqa4_2_hd128", 4, 2, 128, mixed},
      {"three_documents_gqa32_4_hd128", 32, 4, 128, {0, 1, 200, 457}},
      {"mha4_hd64_max_seqlen_above_longest", 4, 4, 64, {0, 130, 131, 333}, true, 300},
      {"non_causal_gqa4_2_hd64", 4, 2, 64, mixed, false},
      // DeepSeek-V2's latent attention: q/k head dim 192 (128 + 64 rope), value head dim 128, a head per kv head.
      {"mixed_documents_mla4_hd192_hdv128", 4, 4, 192, mixed, true, 0, 128},
      // Qwen3.5's full attention, head dim 256: the forward on cuDNN, the backward on our kernels from its out and lse.
      {"mixed_documents_gqa16_2_hd256", 16, 2, 256, mixed},
      {"one_document_mha4_hd256", 4, 4, 256, {0, 256}},
      // Sliding windows (GPT-OSS: causal, 128 keys): documents of 1, 1, 65, 1, 300 and 32 tokens, shorter and longer
      // than the window; a window of 1 (each query sees itself only) and one of 37 off the tile sizes.
      {"mixed_documents_gqa8_1_hd64_window128", 8, 1, 64, mixed, true, 0, 0, 128},
      {"mixed_documents_gqa4_2_hd64_window37", 4, 2, 64, mixed, true, 0, 0, 37},
      {"three_documents_gqa32_4_hd128_window128", 32, 4, 128, {0, 1, 200, 457}, true, 0, 0, 128},
      {"mixed_documents_gqa4_2_hd64_window1", 4, 2, 64, mixed, true, 0, 0, 1},
  };
}

TEST(CudaAttentionCudnn, MatchesCpuReferenceOnTheSameBf16Values) {
  MT_REQUIRE_GPU();
  std::printf("[ cuDNN    ] cuDNN %zu at run time\n", static_cast<size_t>(cudnnGetVersion()));
  // Both sides start from identical bf16 values; the CPU runs in f32. cuDNN keeps f32 accumulators but feeds the
  // probabilities P and dS to its second GEMMs in bf16 and stores out / dq / dk / dv in bf16 (relative 2^-9 per
  // element each), and the backward reads its own bf16 out: a few 1e-3 of relative error, so 2e-2 flags real bugs
  // (a wrong mask, a wrong document boundary or head mapping gives O(1)).
  constexpr double kThreshold = 2e-2;
  uint64_t seed = 1000;
  for (const Case& c : reference_cases()) {
    const Inputs in = random_inputs(c, seed++);
    const ops::AttentionParams params = params_of(c);
    const Results got = run_attention(in, c, params, gpu_device(), DType::BF16);
    const Results want = run_attention(in, c, params, Device::cpu(), DType::F32);
    expect_close(got, want, kThreshold, c.name);
  }
}

TEST(CudaAttentionCudnn, DenseGraphMatchesCpuReference) {
  MT_REQUIRE_GPU();
  // Documents that all fill max_seqlen tokens (T = D * max_seqlen, max_seqlen a power of two >= 64) run a graph
  // without ragged offsets or a padding mask when it is allowed: against the CPU as the ragged graph is (2e-2,
  // MatchesCpuReferenceOnTheSameBf16Values), and it builds graphs of its own (the shapes here are new to the cache).
  constexpr double kThreshold = 2e-2;
  const std::vector<Case> cases = {
      {"dense_one_document_gqa32_4_hd128", 32, 4, 128, {0, 512}},
      {"dense_three_documents_gqa4_2_hd128", 4, 2, 128, {0, 256, 512, 768}},
      {"dense_two_documents_gqa8_1_hd64_window37", 8, 1, 64, {0, 128, 256}, true, 0, 0, 37},
      {"dense_two_documents_mla4_hd192_hdv128", 4, 4, 192, {0, 128, 256}, true, 0, 128},
      {"dense_two_documents_non_causal_gqa4_2_hd64", 4, 2, 64, {0, 64, 128}, false},
  };
  uint64_t seed = 1500;
  for (const Case& c : cases) {
    const Inputs in = random_inputs(c, seed++);
    const ops::AttentionParams params = params_of(c);
    const Results want = run_attention(in, c, params, Device::cpu(), DType::F32);
    const Results ragged = run_attention(in, c, params, gpu_device(), DType::BF16, Route::CudnnRagged);
    expect_close(ragged, want, kThreshold, c.name + " (ragged graph)");
    const int64_t built = ops::cuda::cudnn_attention_graphs_built();
    const Results dense = run_attention(in, c, params, gpu_device(), DType::BF16, Route::CudnnDense);
    EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built() - built, 2) << c.name << ": a dense forward and backward graph";
    expect_close(dense, want, kThreshold, c.name + " (dense graph)");
    // The public ops take the dense graph (kCudnnDenseDocuments).
    expect_close(run_attention(in, c, params, gpu_device(), DType::BF16), want, kThreshold, c.name + " (public ops)");
  }
}

TEST(CudaAttentionCudnn, DenseGraphOnlyForPowerOfTwoRows) {
  MT_REQUIRE_GPU();
  // Documents that fill rows of 300 or 32 tokens keep the ragged graphs of their buckets: the dense graphs stay as few
  // as the ragged ones. Each case runs ragged first, so the dense call must build nothing. (2 / 1 heads: shapes no
  // other test builds, so ReusesTheGraphWithinABucket's counts do not depend on the order the tests run in.)
  for (const Case& c : {Case{"rows_of_300", 2, 1, 64, {0, 300, 600}}, Case{"rows_of_32", 2, 1, 64, {0, 32, 64}}}) {
    const Inputs in = random_inputs(c, 1600);
    run_attention(in, c, params_of(c), gpu_device(), DType::BF16, Route::CudnnRagged);
    const int64_t built = ops::cuda::cudnn_attention_graphs_built();
    run_attention(in, c, params_of(c), gpu_device(), DType::BF16, Route::CudnnDense);
    EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), built) << c.name << ": a dense graph was built";
  }
}

TEST(CudaAttentionCudnn, MatchesOurKernelAtTheWorkloadShape) {
  MT_REQUIRE_GPU();
  // Qwen3-30B-A3B attention: a micro-batch of 2 x 4096 tokens, 32 query heads, 4 kv heads, hd 128. The CPU
  // reference would take minutes here, so the reference is our own bf16 kernel (checked against the CPU in
  // cuda_attention_test.cpp); both store bf16, cuDNN also rounds P and dS to bf16: 2e-2 as above.
  constexpr double kThreshold = 2e-2;
  const Case c{"workload_2x4096_gqa32_4_hd128", 32, 4, 128, {0, 4096, 8192}};
  const Inputs in = random_inputs(c, 2000);
  const Results got = run_attention(in, c, params_of(c), gpu_device(), DType::BF16);
  ops::AttentionParams ours = params_of(c);
  ours.max_seqlen = 0;  // unknown: our kernels
  const Results want = run_attention(in, c, ours, gpu_device(), DType::BF16);
  expect_close(got, want, kThreshold, c.name + " vs our kernel");
}

TEST(CudaAttentionCudnn, BackwardIgnoresWhatItsWorkspaceHeld) {
  MT_REQUIRE_GPU();
  // From cuDNN 9.19 the backward's workspace is not zeroed first (ops/cuda/attention_cudnn.cpp). The pool is filled
  // with NaN bytes (2 GiB, more than any workspace here) and given back before each backward, so a backward that
  // read its workspace before writing it would return NaN; the gradients must match a run on a fresh pool within
  // the backward's own run-to-run spread (it adds dq with atomics) and be finite.
  for (const Case& c : {Case{"workload_2x4096_gqa32_4_hd128", 32, 4, 128, {0, 4096, 8192}}, reference_cases()[7],
                        reference_cases()[6]}) {
    SCOPED_TRACE(c.name);
    const Inputs in = random_inputs(c, 3100);
    const ops::AttentionParams params = params_of(c);
    const Results clean = run_attention(in, c, params, gpu_device(), DType::BF16);
    {
      Tensor junk = Tensor::empty({int64_t{2} << 30}, DType::U8, gpu_device());
      ASSERT_EQ(cudaMemset(junk.raw_data(), 0xff, static_cast<size_t>(junk.numel())), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    const Results poisoned = run_attention(in, c, params, gpu_device(), DType::BF16);
    for (const Tensor* t : {&poisoned.dq, &poisoned.dk, &poisoned.dv}) {
      for (float x : t->to_vector<float>()) ASSERT_TRUE(std::isfinite(x)) << "a gradient read the poisoned workspace";
    }
    expect_close(poisoned, clean, 1e-2, c.name + " after a poisoned pool");
  }
}

TEST(CudaAttentionCudnn, ForwardIsBitwiseRepeatable) {
  MT_REQUIRE_GPU();
  // The forward has no cross-block reduction; the backward accumulates dq with atomics and is not repeatable
  // bitwise (ops/attention.h), so only the forward is pinned here.
  const Case c = reference_cases()[1];
  const Inputs in = random_inputs(c, 3000);
  const ops::AttentionParams params = params_of(c);
  const Tensor q = testing::on_gpu(in.q.to(DType::BF16)), k = testing::on_gpu(in.k.to(DType::BF16));
  const Tensor v = testing::on_gpu(in.v.to(DType::BF16)), cu = testing::on_gpu(cu_tensor(c.cu));
  const int64_t tokens = c.cu.back();
  Tensor out[2], lse[2];
  for (int r = 0; r < 2; ++r) {
    out[r] = Tensor::empty({tokens, c.nh, c.hd}, DType::BF16, gpu_device());
    lse[r] = Tensor::empty({tokens, c.nh}, DType::F32, gpu_device());
    ops::attention_forward(testing::gpu(), out[r], lse[r], q, k, v, cu, params);
  }
  EXPECT_TRUE(testing::same_bytes(out[0], out[1])) << "out differs between two identical runs";
  EXPECT_TRUE(testing::same_bytes(lse[0], lse[1])) << "lse differs between two identical runs";
}

TEST(CudaAttentionCudnn, ReusesTheGraphWithinABucket) {
  MT_REQUIRE_GPU();
  // Buckets: documents rounded up to a power of two, max_seqlen to a power of two (>= 64), and in the backward the
  // token count to a power of two. Calls 1 and 2 share every bucket (2 documents, S 256, T 512); call 3 has S 512.
  const Case first{"first", 4, 2, 64, {0, 100, 300}};
  const Case same_bucket{"same_bucket", 4, 2, 64, {0, 250, 400}};
  const Case other_bucket{"other_bucket", 4, 2, 64, {0, 100, 400}, true, 300};
  const int64_t before = ops::cuda::cudnn_attention_graphs_built();
  run_attention(random_inputs(first, 4000), first, params_of(first), gpu_device(), DType::BF16);
  const int64_t after_first = ops::cuda::cudnn_attention_graphs_built();
  EXPECT_LE(after_first - before, 2) << "one forward and one backward graph at most";
  run_attention(random_inputs(same_bucket, 4001), same_bucket, params_of(same_bucket), gpu_device(), DType::BF16);
  EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), after_first) << "a call in the same bucket built a graph";
  run_attention(random_inputs(other_bucket, 4002), other_bucket, params_of(other_bucket), gpu_device(), DType::BF16);
  EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), after_first + 2)
      << "a new sequence bucket needs a new forward and backward graph";
}

TEST(CudaAttentionCudnn, CausalSlidingWindowRunsOnCudnnWithItsOwnGraphs) {
  MT_REQUIRE_GPU();
  // A causal window is part of the graph key: windows 16 and 17 in one shape bucket (2 documents, S 128, T 256) build
  // their own forward and backward graphs, and a window of S = 128 or more hides nothing and reuses the graphs of
  // plain causal attention. Every call matches the CPU reference (the threshold of
  // MatchesCpuReferenceOnTheSameBf16Values).
  const Case base{"windows", 4, 2, 64, {0, 100, 130}};
  const Inputs in = random_inputs(base, 4500);
  const auto run_window = [&](int window) {
    Case c = base;
    c.window = window;
    c.name = fmt::format("window {}", window);
    const int64_t before = ops::cuda::cudnn_attention_graphs_built();
    const Results got = run_attention(in, c, params_of(c), gpu_device(), DType::BF16);
    const int64_t built = ops::cuda::cudnn_attention_graphs_built() - before;
    expect_close(got, run_attention(in, c, params_of(c), Device::cpu(), DType::F32), 2e-2, c.name);
    return built;
  };
  run_window(0);  // plain causal: built now or by an earlier test
  EXPECT_EQ(run_window(16), 2) << "a new window needs a new forward and backward graph";
  EXPECT_EQ(run_window(16), 0) << "the same window reuses its graphs";
  EXPECT_EQ(run_window(17), 2) << "another window needs its own graphs";
  EXPECT_EQ(run_window(128), 0) << "a window of S keys hides nothing: the plain causal graphs";
  EXPECT_EQ(run_window(5000), 0) << "a window beyond S: the plain causal graphs";
  // The same window with max_seqlen unknown runs on our kernels and builds no graph.
  Case c = base;
  c.window = 16;
  ops::AttentionParams ours = params_of(c);
  ours.max_seqlen = 0;
  const int64_t before = ops::cuda::cudnn_attention_graphs_built();
  run_attention(in, c, ours, gpu_device(), DType::BF16);
  EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), before) << "max_seqlen 0 went to cuDNN";
}

TEST(CudaAttentionCudnn, HeadDim256RunsItsBackwardOnCudnnOnlyFromTheFirstRightRelease) {
  MT_REQUIRE_GPU();
  // With cuDNN 9.19 or later at run time both directions run on cuDNN (two graphs); with an older one the forward runs
  // on cuDNN and the backward on our kernels (one graph). Either way the gradients match the CPU.
  const Case c{"hd256_graphs", 16, 2, 256, {0, 77, 300}};
  const ops::AttentionParams params = params_of(c);
  const bool backward_on_cudnn = ops::cuda::cudnn_runtime_version() >= ops::cuda::kCudnnFirstRightHeadDim256Backward;
  EXPECT_TRUE(ops::cuda::cudnn_attention_supports(DType::BF16, 256, 256, params));
  EXPECT_EQ(ops::cuda::cudnn_attention_backward_supports(DType::BF16, 256, 256, params), backward_on_cudnn);
  EXPECT_TRUE(ops::cuda::cudnn_attention_backward_supports(DType::BF16, 128, 128, params));
  const Inputs in = random_inputs(c, 6000);
  const int64_t before = ops::cuda::cudnn_attention_graphs_built();
  const Results got = run_attention(in, c, params, gpu_device(), DType::BF16);
  EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), before + (backward_on_cudnn ? 2 : 1))
      << "cuDNN " << ops::cuda::cudnn_runtime_version();
  expect_close(got, run_attention(in, c, params, Device::cpu(), DType::F32), 2e-2,
               fmt::format("hd256 on cuDNN {}", ops::cuda::cudnn_runtime_version()));
}

TEST(CudaAttentionCudnn, OtherCallsStayOnOurKernels) {
  MT_REQUIRE_GPU();
  // f32, an unknown max_seqlen, hd 96 and a non-causal (symmetric) sliding window all run on our kernels: no cuDNN
  // graph is built (and the results still match the CPU, which cuda_attention_test.cpp checks in depth).
  struct Variant {
    std::string name;
    DType dtype;
    int64_t hd, max_seqlen;
    int window;
    bool causal;
  };
  const std::vector<Variant> variants = {{"f32", DType::F32, 64, 65, 0, true},
                                         {"max_seqlen_unknown", DType::BF16, 64, 0, 0, true},
                                         {"hd96", DType::BF16, 96, 65, 0, true},
                                         {"non_causal_sliding_window", DType::BF16, 64, 65, 16, false}};
  for (const Variant& var : variants) {
    const Case c{var.name, 4, 2, var.hd, {0, 65, 100}};
    ops::AttentionParams params = params_of(c);
    params.max_seqlen = var.max_seqlen;
    params.sliding_window = var.window;
    params.causal = var.causal;
    const Inputs in = random_inputs(c, 5000);
    const int64_t before = ops::cuda::cudnn_attention_graphs_built();
    const Results got = run_attention(in, c, params, gpu_device(), var.dtype);
    EXPECT_EQ(ops::cuda::cudnn_attention_graphs_built(), before) << var.name << ": went to cuDNN";
    const Results want = run_attention(in, c, params, Device::cpu(), DType::F32);
    EXPECT_LT(relative_error(got.out, want.out), 2e-2) << var.name << ": out differs from the CPU";
  }
}

TEST(CudaAttentionCudnn, RejectsMaxSeqlenOutsideItsRange) {
  MT_REQUIRE_GPU();
  const Case c{"checks", 4, 2, 64, {0, 10, 30}};
  const Inputs in = random_inputs(c, 6000);
  const int64_t tokens = c.cu.back();
  for (const Device device : {gpu_device(), Device::cpu()}) {
    const DType dtype = device.is_cuda() ? DType::BF16 : DType::F32;
    const Tensor q = in.q.to(dtype).to(device), k = in.k.to(dtype).to(device), v = in.v.to(dtype).to(device);
    const Tensor cu = cu_tensor(c.cu).to(device);
    Tensor out = Tensor::empty({tokens, c.nh, c.value_dim()}, dtype, device);
    Tensor lse = Tensor::empty({tokens, c.nh}, device.is_cuda() ? DType::F32 : dtype, device);
    Stream& s = default_stream(device);
    ops::AttentionParams params = params_of(c);
    params.max_seqlen = -1;
    expect_error([&] { ops::attention_forward(s, out, lse, q, k, v, cu, params); },
                 "max_seqlen must be in [0, T = 30] (0 = unknown) but found -1");
    params.max_seqlen = tokens + 1;
    expect_error([&] { ops::attention_forward(s, out, lse, q, k, v, cu, params); },
                 "max_seqlen must be in [0, T = 30] (0 = unknown) but found 31");
    if (device.is_cpu()) {  // only the CPU can read cu_seqlens to compare
      params.max_seqlen = 19;
      expect_error([&] { ops::attention_forward(s, out, lse, q, k, v, cu, params); },
                   "max_seqlen (19) must cover the longest document but document 1 has 20 tokens");
    }
  }
}

TEST(CudaAttentionCudnn, DenseStatisticsAreTheLseTransposed) {
  MT_REQUIRE_GPU();
  // stats_to_bhsd: lse [B S, nh] (token-major, as every attention kernel writes it) -> [B, nh, S] for the dense
  // backward; every value moved, none changed. And its refusals, and check_dense_documents'.
  constexpr int64_t kBatch = 3, kSeq = 5, kHeads = 4;
  std::vector<float> values(kBatch * kSeq * kHeads);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) + 0.25f;
  const Tensor lse = Tensor::from_vector<float>(values, {kBatch * kSeq, kHeads}).to(gpu_device());
  Tensor bhsd = Tensor::empty({kBatch * kSeq, kHeads}, DType::F32, gpu_device());
  Stream& s = testing::gpu();
  ops::cuda::stats_to_bhsd(s, bhsd, lse, kBatch, kSeq);
  const std::vector<float> got = testing::host_f32(bhsd).to_vector<float>();
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kSeq; ++i) {
        ASSERT_EQ(got[static_cast<size_t>((b * kHeads + h) * kSeq + i)],
                  values[static_cast<size_t>((b * kSeq + i) * kHeads + h)])
            << "b " << b << " h " << h << " i " << i;
      }
    }
  }
  expect_error([&] { ops::cuda::stats_to_bhsd(s, bhsd, lse, kBatch, kSeq + 1); },
               "stats_to_bhsd: expected lse f32 [3 x 6, heads]");
  const Tensor short_buffer = Tensor::empty({kHeads}, DType::F32, gpu_device());
  expect_error([&] { ops::cuda::stats_to_bhsd(s, short_buffer, lse, kBatch, kSeq); },
               "stats_to_bhsd: expected an f32 buffer of 60 elements");
  const Tensor cu_i64 = Tensor::from_vector<int64_t>({0, 5}, {2}).to(gpu_device());
  expect_error([&] { ops::cuda::check_dense_documents(s, cu_i64, kSeq); },
               "check_dense_documents: expected cu_seqlens i32 with at least 2 entries");
}

// Milliseconds per call of `fn`, timed with CUDA events on the compute stream over `iterations` after `warmups`.
template <typename Fn>
double time_ms(Fn&& fn, int warmups, int iterations) {
  const auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(testing::gpu()));
  for (int i = 0; i < warmups; ++i) fn();
  cudaEvent_t start = nullptr, stop = nullptr;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
  for (int i = 0; i < iterations; ++i) fn();
  EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(ms) / iterations;
}

TEST(CudaAttentionCudnnBench, DISABLED_Throughput) {
  MT_REQUIRE_GPU();
  // The workload of record: T = 8192 as 2 documents of 4096, 32 / 4 heads, hd 128, causal. FLOPs per document:
  // forward 4 S^2 / 2 nh hd (QK^T and PV over the causal half), backward 2.5x the forward.
  const Case c{"bench", 32, 4, 128, {0, 4096, 8192}};
  const int64_t tokens = c.cu.back();
  const double fwd_flops = 2.0 * 4.0 * 4096.0 * 4096.0 / 2.0 * static_cast<double>(c.nh * c.hd);
  const double fwd_bwd_flops = fwd_flops * 3.5;
  Rng rng(7000);
  const auto dev = [&](const Shape& shape) {
    return random_tensor(shape, DType::F32, rng).to(DType::BF16).to(gpu_device());
  };
  const Tensor q = dev({tokens, c.nh, c.hd}), k = dev({tokens, c.nkv, c.hd}), v = dev({tokens, c.nkv, c.hd});
  const Tensor dout = dev({tokens, c.nh, c.hd});
  const Tensor cu = testing::on_gpu(cu_tensor(c.cu));
  Tensor out = Tensor::empty({tokens, c.nh, c.hd}, DType::BF16, gpu_device());
  Tensor lse = Tensor::empty({tokens, c.nh}, DType::F32, gpu_device());
  Tensor dq = Tensor::empty({tokens, c.nh, c.hd}, DType::BF16, gpu_device());
  Tensor dk = Tensor::empty({tokens, c.nkv, c.hd}, DType::BF16, gpu_device());
  Tensor dv = Tensor::empty({tokens, c.nkv, c.hd}, DType::BF16, gpu_device());
  Stream& s = testing::gpu();
  // cuDNN's ragged graph (what the public ops run), its dense graph (the documents fill their rows), our kernel.
  for (const int form : {0, 1, 2}) {
    ops::AttentionParams params = params_of(c);
    if (form == 2) params.max_seqlen = 0;  // our kernels
    const auto forward = [&] {
      if (form == 2) {
        ops::attention_forward(s, out, lse, q, k, v, cu, params);
      } else {
        ops::cuda::cudnn_attention_forward(s, out, lse, q, k, v, cu, params, /*allow_dense=*/form == 1);
      }
    };
    const auto backward = [&] {
      if (form == 2) {
        ops::attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, params);
      } else {
        ops::cuda::cudnn_attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, params,
                                            /*allow_dense=*/form == 1);
      }
    };
    const double fwd_ms = time_ms(forward, 3, 20);
    const double fwd_bwd_ms = time_ms(
        [&] {
          forward();
          backward();
        },
        3, 20);
    const char* name = form == 0 ? "cuDNN SDPA (ragged)" : form == 1 ? "cuDNN SDPA (dense)" : "our kernel";
    std::printf(
        "[ bench    ] %s, T=8192 (2 x 4096), 32/4 heads, hd 128, bf16 causal: forward %.3f ms = %.1f TFLOP/s, "
        "forward+backward %.3f ms = %.1f TFLOP/s\n",
        name, fwd_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, fwd_bwd_ms, fwd_bwd_flops / (fwd_bwd_ms * 1e-3) / 1e12);
    EXPECT_GT(fwd_ms, 0.0) << name;
  }
}

#else

TEST(CudaAttentionCudnn, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA: cuDNN attention tests skipped"; }

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace moetrain
