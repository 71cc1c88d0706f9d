// Tests for the CUDA attention kernels (ops/cuda/attention.*) through the public ops: forward (out, lse) and
// backward (dq, dk, dv) against the CPU reference on the same inputs (GQA, head dims 64 / 128 / 96 with hdv 64,
// single-token and long documents, sliding window, non-causal), in f32 and bf16; bitwise determinism; bitwise
// packing invariance (a document's rows do not change with what is packed around it); and the CUDA argument checks.
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ops/attention.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::random_tensor;
using testing::relative_error;

Device gpu() { return Device::cuda(0); }

Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector<int32_t>(cu, {static_cast<int64_t>(cu.size())});
}

struct Case {
  std::string name;
  int64_t nh, nkv, hd, hdv;
  std::vector<int32_t> cu;
  ops::AttentionParams params;
};

ops::AttentionParams causal(int64_t hd, int window = 0) {
  ops::AttentionParams p;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  p.sliding_window = window;
  return p;
}

// Single-token documents, a document across the 64-row tile boundaries, a 300-token document, a short tail.
const std::vector<int32_t> kMixedDocs = {0, 1, 2, 67, 68, 368, 400};

std::vector<Case> cases() {
  ops::AttentionParams non_causal = causal(64, 20);
  non_causal.causal = false;
  return {
      {"gqa_hd64", 8, 2, 64, 64, kMixedDocs, causal(64)},
      {"gqa_hd128", 8, 2, 128, 128, kMixedDocs, causal(128)},
      {"gqa_hd64_window37", 8, 2, 64, 64, kMixedDocs, causal(64, 37)},
      {"mha_hd96_hdv64", 4, 4, 96, 64, {0, 130, 131, 333}, causal(96)},
      {"gqa_hd64_non_causal_window20", 8, 2, 64, 64, kMixedDocs, non_causal},
      {"one_token", 2, 1, 64, 64, {0, 1}, causal(64)},
      // Head dims past 128 take the wide tiles (4 rows per warp, 8 columns per lane): Qwen3.5's full attention (256)
      // and an uneven pair.
      {"gqa_hd256", 8, 2, 256, 256, kMixedDocs, causal(256)},
      {"mha_hd200_hdv160", 4, 4, 200, 160, {0, 130, 131, 333}, causal(200)},
  };
}

// Every tensor of one attention call: inputs (q, k, v, dout), forward outputs and gradients.
struct Results {
  Tensor out, lse, dq, dk, dv;
};

struct Inputs {
  Tensor q, k, v, dout;  // f32 on the CPU; bf16-representable values when the GPU run is bf16
};

Inputs random_inputs(const Case& c, DType gpu_dtype, uint64_t seed) {
  Rng rng(seed);
  const int64_t tokens = c.cu.back();
  Inputs in{random_tensor({tokens, c.nh, c.hd}, DType::F32, rng), random_tensor({tokens, c.nkv, c.hd}, DType::F32, rng),
            random_tensor({tokens, c.nkv, c.hdv}, DType::F32, rng),
            random_tensor({tokens, c.nh, c.hdv}, DType::F32, rng)};
  if (gpu_dtype == DType::BF16) {
    for (Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) *t = t->to(DType::BF16).to(DType::F32);
  }
  return in;
}

// Forward and backward of the public ops on `device` in `dtype`; results come back as f32 CPU tensors.
Results run_attention(const Inputs& in, const Case& c, Device device, DType dtype) {
  const auto put = [&](const Tensor& t) { return t.to(dtype).to(device); };
  const Tensor q = put(in.q), k = put(in.k), v = put(in.v), dout = put(in.dout);
  const Tensor cu = cu_tensor(c.cu).to(device);
  const int64_t tokens = c.cu.back();
  const DType lse_dtype = device.is_cuda() ? DType::F32 : dtype;
  Tensor out = Tensor::empty({tokens, c.nh, c.hdv}, dtype, device);
  Tensor lse = Tensor::empty({tokens, c.nh}, lse_dtype, device);
  Tensor dq = Tensor::empty({tokens, c.nh, c.hd}, dtype, device);
  Tensor dk = Tensor::empty({tokens, c.nkv, c.hd}, dtype, device);
  Tensor dv = Tensor::empty({tokens, c.nkv, c.hdv}, dtype, device);
  Stream& s = default_stream(device);
  ops::attention_forward(s, out, lse, q, k, v, cu, c.params);
  ops::attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, c.params);
  const auto back = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); };
  return {back(out), back(lse), back(dq), back(dk), back(dv)};
}

void expect_close(const Results& gpu_run, const Results& cpu_run, double threshold, const std::string& what) {
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> pairs[] = {
      {"out", {&gpu_run.out, &cpu_run.out}},
      {"lse", {&gpu_run.lse, &cpu_run.lse}},
      {"dq", {&gpu_run.dq, &cpu_run.dq}},
      {"dk", {&gpu_run.dk, &cpu_run.dk}},
      {"dv", {&gpu_run.dv, &cpu_run.dv}}};
  for (const auto& [name, tensors] : pairs) {
    if (testing::max_abs_diff(*tensors.second, Tensor::zeros(tensors.second->shape(), DType::F32)) == 0.0) {
      // A gradient that is zero by the math (dq, dk of a one-token batch: dp - D = dout.v - dout.out = 0): the GPU
      // keeps the rounding noise of two length-hdv f32 dot products of O(1) terms, ~1e-6, instead of a relative error.
      constexpr double kZeroTolerance = 1e-5;
      const double diff = testing::max_abs_diff(*tensors.first, *tensors.second);
      EXPECT_LT(diff, kZeroTolerance) << what << ": " << name << " is zero on the CPU, max |gpu| = " << diff;
      continue;
    }
    const double err = relative_error(*tensors.first, *tensors.second);
    EXPECT_LT(err, threshold) << what << ": " << name << " relative error ||gpu - cpu|| / ||cpu|| = " << err
                              << " (max abs diff " << testing::max_abs_diff(*tensors.first, *tensors.second) << ")";
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

TEST(CudaAttention, F32MatchesCpuReference) {
  MT_REQUIRE_GPU();
  // f32 throughout: the online softmax (per-tile rescaling) and the fused multiply-adds differ from the CPU's
  // two-pass softmax only by rounding, ~1e-7 per operation over reductions of at most 300 keys x 4 heads.
  constexpr double kThreshold = 1e-5;
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, DType::F32, seed++);
    expect_close(run_attention(in, c, gpu(), DType::F32), run_attention(in, c, Device::cpu(), DType::F32), kThreshold,
                 c.name + " f32");
  }
}

TEST(CudaAttention, Bf16MatchesCpuReferenceOnTheSameValues) {
  MT_REQUIRE_GPU();
  // Inputs are bf16 values on both sides; the GPU keeps f32 inside but stores out / dq / dk / dv in bf16 (one
  // rounding, relative 2^-9 per element) and its backward reads its own bf16 out, so ~1e-3 is expected.
  constexpr double kThreshold = 2e-2;
  uint64_t seed = 200;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, DType::BF16, seed++);
    expect_close(run_attention(in, c, gpu(), DType::BF16), run_attention(in, c, Device::cpu(), DType::F32), kThreshold,
                 c.name + " bf16");
  }
}

TEST(CudaAttention, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  for (const DType dtype : {DType::F32, DType::BF16}) {
    for (const Case& c : {cases()[1], cases()[2]}) {
      const Inputs in = random_inputs(c, dtype, 300);
      const Results a = run_attention(in, c, gpu(), dtype);
      const Results b = run_attention(in, c, gpu(), dtype);
      EXPECT_TRUE(same_bytes(a.out, b.out)) << c.name << " " << dtype_name(dtype) << ": out";
      EXPECT_TRUE(same_bytes(a.lse, b.lse)) << c.name << " " << dtype_name(dtype) << ": lse";
      EXPECT_TRUE(same_bytes(a.dq, b.dq)) << c.name << " " << dtype_name(dtype) << ": dq";
      EXPECT_TRUE(same_bytes(a.dk, b.dk)) << c.name << " " << dtype_name(dtype) << ": dk";
      EXPECT_TRUE(same_bytes(a.dv, b.dv)) << c.name << " " << dtype_name(dtype) << ": dv";
    }
  }
}

TEST(CudaAttention, DocumentRowsAreBitwiseIndependentOfPacking) {
  MT_REQUIRE_GPU();
  // Document A (300 tokens) alone, then packed at offset 37 between two other documents: A's rows of every output
  // and gradient must keep their bits (tiles start at document starts; reductions run in document order).
  const int64_t nh = 8, nkv = 2, hd = 64, len = 300, before = 37, after = 63;
  for (const int window : {0, 50}) {
    const Case alone{"alone", nh, nkv, hd, hd, {0, static_cast<int32_t>(len)}, causal(hd, window)};
    const Case packed{"packed",
                      nh,
                      nkv,
                      hd,
                      hd,
                      {0, static_cast<int32_t>(before), static_cast<int32_t>(before + len),
                       static_cast<int32_t>(before + len + after)},
                      causal(hd, window)};
    const Inputs a = random_inputs(alone, DType::F32, 400);
    Inputs p = random_inputs(packed, DType::F32, 401);
    const std::vector<std::pair<Tensor*, const Tensor*>> placed = {
        {&p.q, &a.q}, {&p.k, &a.k}, {&p.v, &a.v}, {&p.dout, &a.dout}};
    for (const auto& [dst, src] : placed) dst->slice(before, before + len).copy_from(*src);
    const Results ra = run_attention(a, alone, gpu(), DType::F32);
    const Results rp = run_attention(p, packed, gpu(), DType::F32);
    const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> outputs[] = {{"out", {&ra.out, &rp.out}},
                                                                                       {"lse", {&ra.lse, &rp.lse}},
                                                                                       {"dq", {&ra.dq, &rp.dq}},
                                                                                       {"dk", {&ra.dk, &rp.dk}},
                                                                                       {"dv", {&ra.dv, &rp.dv}}};
    for (const auto& [name, t] : outputs) {
      EXPECT_TRUE(same_bytes(*t.first, t.second->slice(before, before + len)))
          << name << " (window " << window << "): rows of the packed document differ from the document alone";
    }
  }
}

TEST(CudaAttention, RejectsWhatTheKernelsDoNotTake) {
  MT_REQUIRE_GPU();
  Rng rng(500);
  const auto dev = [&](const Shape& shape, DType dtype) {
    return random_tensor(shape, DType::F32, rng).to(dtype).to(gpu());
  };
  const int64_t tokens = 6;
  const Tensor cu = cu_tensor({0, 2, 6}).to(gpu());
  Stream& s = default_stream(gpu());
  const ops::AttentionParams params = causal(64);
  {  // head dim above 256
    const Tensor q = dev({tokens, 2, 288}, DType::F32), k = dev({tokens, 1, 288}, DType::F32);
    const Tensor v = dev({tokens, 1, 64}, DType::F32);
    Tensor out = Tensor::empty({tokens, 2, 64}, DType::F32, gpu()), lse = Tensor::empty({tokens, 2}, DType::F32, gpu());
    expect_error([&] { ops::attention_forward(s, out, lse, q, k, v, cu, params); }, "head dims in [1, 256]");
  }
  const Tensor q = dev({tokens, 2, 64}, DType::BF16), k = dev({tokens, 1, 64}, DType::BF16);
  const Tensor v = dev({tokens, 1, 64}, DType::BF16);
  Tensor out = Tensor::empty({tokens, 2, 64}, DType::BF16, gpu());
  Tensor lse = Tensor::empty({tokens, 2}, DType::F32, gpu());
  {  // lse must be f32 on CUDA
    Tensor lse_bf16 = Tensor::empty({tokens, 2}, DType::BF16, gpu());
    expect_error([&] { ops::attention_forward(s, out, lse_bf16, q, k, v, cu, params); }, "attention_forward: lse");
  }
  {  // f64 has no CUDA kernel
    const Tensor q64 = random_tensor({tokens, 2, 64}, DType::F64, rng).to(gpu());
    expect_error([&] { ops::attention_forward(s, out, lse, q64, k, v, cu, params); }, "f32 or bf16 on CUDA");
  }
  // cu_seqlens on the CPU with CUDA tensors, or with more documents than tokens.
  expect_error(
      [&] {
        ops::attention_forward(s, out, lse, q, k, v, cu_tensor({0, 2, 6}), params);
      },
      "attention_forward: cu_seqlens: expected a tensor on cuda:0");
  expect_error(
      [&] {
        ops::attention_forward(s, out, lse, q, k, v, cu_tensor({0, 1, 2, 3, 4, 5, 6, 7}).to(gpu()), params);
      },
      "between 2 and T + 1 = 7 entries");
  // The stream must run on the tensors' device; every tensor on q's device.
  expect_error([&] { ops::attention_forward(Stream::cpu(), out, lse, q, k, v, cu, params); },
               "q is on cuda:0 but the stream runs on cpu");
  Tensor out_cpu = Tensor::empty({tokens, 2, 64}, DType::BF16);
  expect_error([&] { ops::attention_forward(s, out_cpu, lse, q, k, v, cu, params); }, "expected out on cuda:0");
}

}  // namespace
}  // namespace moetrain
