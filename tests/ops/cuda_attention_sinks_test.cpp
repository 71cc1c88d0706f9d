// Tests for the CUDA attention-sink kernels (ops/cuda/attention_sinks.*) through the public ops: the sink ops alone on
// the same inputs as the CPU reference (f32 and bf16, several token chunks, head counts and widths off the warp
// multiples); attention + sinks forward and backward against the CPU reference with packed documents shorter and
// longer than the sliding window, on our kernels (f32, bf16) and on cuDNN (bf16); bitwise determinism; and the CUDA
// argument checks.
#include <algorithm>
#include <cmath>
#include <cstdint>
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
using testing::same_bytes;

Device gpu() { return Device::cuda(0); }

Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector<int32_t>(cu, {static_cast<int64_t>(cu.size())});
}

Tensor back(const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); }

void expect_close(const Tensor& gpu_value, const Tensor& cpu_value, double threshold, const std::string& what) {
  const double err = relative_error(gpu_value, cpu_value);
  EXPECT_LT(err, threshold) << what << ": relative error ||gpu - cpu|| / ||cpu|| = " << err << " (max abs diff "
                            << testing::max_abs_diff(gpu_value, cpu_value) << ")";
}

// --- The sink ops alone -------------------------------------------------------------------------------------------

struct SinkInputs {
  Tensor out, lse, sinks, dout;  // f32 on the CPU; out and dout bf16-representable when the GPU run is bf16
};

SinkInputs random_sink_inputs(int64_t tokens, int64_t nh, int64_t hdv, DType gpu_dtype, uint64_t seed) {
  Rng rng(seed);
  SinkInputs in{random_tensor({tokens, nh, hdv}, DType::F32, rng), random_tensor({tokens, nh}, DType::F32, rng),
                random_tensor({nh}, DType::F32, rng), random_tensor({tokens, nh, hdv}, DType::F32, rng)};
  if (gpu_dtype == DType::BF16) {
    for (Tensor* t : {&in.out, &in.dout}) *t = testing::rounded_to_bf16(*t);
  }
  return in;
}

struct SinkResults {
  Tensor out, lse, dsinks;  // f32 on the CPU
};

// attention_sinks_forward on a copy of out / lse, then attention_sinks_backward with the rewritten ones into dsinks
// that starts at 0.25 per head (the op accumulates). On the CPU (the reference, run in f64) every tensor takes
// `dtype`; on CUDA lse, sinks and dsinks stay f32.
SinkResults run_sink_ops(const SinkInputs& in, Device device, DType dtype) {
  const DType small = device.is_cuda() ? DType::F32 : dtype;
  Tensor out = in.out.to(dtype).to(device), lse = in.lse.to(small).to(device);
  const Tensor sinks = in.sinks.to(small).to(device), dout = in.dout.to(dtype).to(device);
  Tensor dsinks =
      Tensor::from_vector<float>(std::vector<float>(static_cast<size_t>(in.sinks.numel()), 0.25f), {in.sinks.numel()})
          .to(small)
          .to(device);
  Stream& s = default_stream(device);
  ops::attention_sinks_forward(s, out, lse, sinks);
  ops::attention_sinks_backward(s, dsinks, dout, out, lse, sinks);
  return {back(out), back(lse), back(dsinks)};
}

// The f64 CPU sink gradient (from 0.25 per head, as run_sink_ops) read from the GPU forward's own out and lse: it
// isolates the GPU backward from the rounding of the GPU forward's bf16 out.
Tensor reference_dsinks(const SinkInputs& in, const SinkResults& gpu_run) {
  const auto f64 = [](const Tensor& t) { return t.to(DType::F64); };
  Tensor dsinks = f64(
      Tensor::from_vector<float>(std::vector<float>(static_cast<size_t>(in.sinks.numel()), 0.25f), {in.sinks.numel()}));
  ops::attention_sinks_backward(Stream::cpu(), dsinks, f64(in.dout), f64(gpu_run.out), f64(gpu_run.lse), f64(in.sinks));
  return back(dsinks);
}

TEST(CudaAttentionSinks, OpsMatchCpuOnTheSameInputs) {
  MT_REQUIRE_GPU();
  // The sink ops alone, CPU reference in f64. (T, nh, hdv): one partial chunk; 5 chunks with nh a multiple of the 8
  // warps per block; 65 chunks with nh and hdv off the warp multiples; 313 chunks, more than the 256 threads of the
  // final tree.
  const std::vector<std::vector<int64_t>> shapes = {{5, 8, 64}, {300, 16, 64}, {4099, 3, 45}, {20000, 2, 64}};
  uint64_t seed = 10;
  for (const auto& shape : shapes) {
    const std::string name = fmt::format("T={} nh={} hdv={}", shape[0], shape[1], shape[2]);
    {
      // f32 against the f64 reference on the same values: expf / log1pf and f32 products (a few ulp each), and
      // for dsinks (read from the GPU forward's outputs) f32 sums of 64-token chunks and a 256-leaf tree (~1e-7 per
      // addition, a few dozen deep).
      constexpr double kThreshold = 1e-5;
      const SinkInputs in = random_sink_inputs(shape[0], shape[1], shape[2], DType::F32, seed++);
      const SinkResults g = run_sink_ops(in, gpu(), DType::F32), c = run_sink_ops(in, Device::cpu(), DType::F64);
      expect_close(g.out, c.out, kThreshold, name + " f32 out");
      expect_close(g.lse, c.lse, kThreshold, name + " f32 lse");
      expect_close(g.dsinks, reference_dsinks(in, g), kThreshold, name + " f32 dsinks");
    }
    {
      // bf16: the GPU stores the rescaled out in bf16 (one rounding, relative 2^-9 per element) where the reference
      // keeps f64; lse stays f32. dsinks is checked on the GPU forward's own bf16 out (exact in f64), so only the f32
      // arithmetic of the f32 case remains.
      constexpr double kOutThreshold = 4e-3, kLseThreshold = 1e-5, kSinkThreshold = 1e-5;
      const SinkInputs in = random_sink_inputs(shape[0], shape[1], shape[2], DType::BF16, seed++);
      const SinkResults g = run_sink_ops(in, gpu(), DType::BF16), c = run_sink_ops(in, Device::cpu(), DType::F64);
      expect_close(g.out, c.out, kOutThreshold, name + " bf16 out");
      expect_close(g.lse, c.lse, kLseThreshold, name + " bf16 lse");
      expect_close(g.dsinks, reference_dsinks(in, g), kSinkThreshold, name + " bf16 dsinks");
    }
  }
}

// --- Attention with sinks -----------------------------------------------------------------------------------------

struct Case {
  std::string name;
  int64_t nh, nkv, hd, hdv;
  std::vector<int32_t> cu;
  int window;
};

// Three single-token documents, a 65-token document across the 64-row tile boundary, a 300-token one and a 32-token
// tail: with a window of 37 (or GPT-OSS's 128) some documents are shorter than the window and some longer.
const std::vector<int32_t> kMixedDocs = {0, 1, 2, 3, 68, 368, 400};

std::vector<Case> cases() {
  return {
      {"gqa_hd64_full", 8, 2, 64, 64, kMixedDocs, 0},
      {"gqa_hd64_window37", 8, 2, 64, 64, kMixedDocs, 37},
      {"gqa_hd64_window128", 8, 2, 64, 64, kMixedDocs, 128},
      {"mha_hd96_hdv64_window37", 4, 4, 96, 64, {0, 130, 131, 333}, 37},
  };
}

struct Inputs {
  Tensor q, k, v, dout, sinks;  // f32 on the CPU; q, k, v, dout bf16-representable when the GPU run is bf16
};

Inputs random_inputs(const Case& c, DType gpu_dtype, uint64_t seed) {
  Rng rng(seed);
  const int64_t tokens = c.cu.back();
  Inputs in{random_tensor({tokens, c.nh, c.hd}, DType::F32, rng), random_tensor({tokens, c.nkv, c.hd}, DType::F32, rng),
            random_tensor({tokens, c.nkv, c.hdv}, DType::F32, rng),
            random_tensor({tokens, c.nh, c.hdv}, DType::F32, rng), random_tensor({c.nh}, DType::F32, rng, 1.5)};
  if (gpu_dtype == DType::BF16) {
    for (Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) *t = testing::rounded_to_bf16(*t);
  }
  return in;
}

struct Results {
  Tensor out, lse, dq, dk, dv, dsinks;  // f32 on the CPU
};

// GPT-OSS's attention on `device`: attention_forward, attention_sinks_forward, then attention_backward with the sinked
// out / lse and attention_sinks_backward. max_seqlen 0 (the default) keeps CUDA on our deterministic kernels; the
// longest document sends bf16 calls with hd 64 / 128 to cuDNN.
Results run_attention(const Inputs& in, const Case& c, Device device, DType dtype, int64_t max_seqlen = 0) {
  const auto put = [&](const Tensor& t) { return t.to(dtype).to(device); };
  const Tensor q = put(in.q), k = put(in.k), v = put(in.v), dout = put(in.dout), sinks = in.sinks.to(device);
  const Tensor cu = cu_tensor(c.cu).to(device);
  const int64_t tokens = c.cu.back();
  ops::AttentionParams params;
  params.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.hd)));
  params.sliding_window = c.window;
  params.max_seqlen = max_seqlen;
  Tensor out = Tensor::empty({tokens, c.nh, c.hdv}, dtype, device);
  Tensor lse = Tensor::empty({tokens, c.nh}, DType::F32, device);
  Tensor dq = Tensor::empty({tokens, c.nh, c.hd}, dtype, device);
  Tensor dk = Tensor::empty({tokens, c.nkv, c.hd}, dtype, device);
  Tensor dv = Tensor::empty({tokens, c.nkv, c.hdv}, dtype, device);
  Tensor dsinks = Tensor::zeros({c.nh}, DType::F32, device);
  Stream& s = default_stream(device);
  ops::attention_forward(s, out, lse, q, k, v, cu, params);
  ops::attention_sinks_forward(s, out, lse, sinks);
  ops::attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, cu, params);
  ops::attention_sinks_backward(s, dsinks, dout, out, lse, sinks);
  return {back(out), back(lse), back(dq), back(dk), back(dv), back(dsinks)};
}

void expect_results_close(const Results& g, const Results& c, double threshold, const std::string& what) {
  expect_close(g.out, c.out, threshold, what + ": out");
  expect_close(g.lse, c.lse, threshold, what + ": lse");
  expect_close(g.dq, c.dq, threshold, what + ": dq");
  expect_close(g.dk, c.dk, threshold, what + ": dk");
  expect_close(g.dv, c.dv, threshold, what + ": dv");
  expect_close(g.dsinks, c.dsinks, threshold, what + ": dsinks");
}

TEST(CudaAttentionSinks, F32AttentionWithSinksMatchesCpuReference) {
  MT_REQUIRE_GPU();
  // f32 throughout: the attention kernels' online softmax and fused multiply-adds differ from the CPU's two-pass
  // softmax by rounding only (the bound of CudaAttention.F32MatchesCpuReference), and the sink ops add a few ulp.
  constexpr double kThreshold = 1e-5;
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, DType::F32, seed++);
    expect_results_close(run_attention(in, c, gpu(), DType::F32), run_attention(in, c, Device::cpu(), DType::F32),
                         kThreshold, c.name + " f32");
  }
}

TEST(CudaAttentionSinks, Bf16AttentionWithSinksMatchesCpuReferenceOnTheSameValues) {
  MT_REQUIRE_GPU();
  // Inputs are bf16 values on both sides; the GPU stores out (before and after the sinks) and dq / dk / dv in bf16
  // (relative 2^-9 per rounding) and its backward reads its own bf16 out: the bound of
  // CudaAttention.Bf16MatchesCpuReferenceOnTheSameValues. dsinks sums <dout, out'> terms of random sign, each off by
  // the same relative amount.
  constexpr double kThreshold = 2e-2;
  uint64_t seed = 200;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, DType::BF16, seed++);
    expect_results_close(run_attention(in, c, gpu(), DType::BF16), run_attention(in, c, Device::cpu(), DType::F32),
                         kThreshold, c.name + " bf16");
  }
}

TEST(CudaAttentionSinks, Bf16AttentionWithSinksThroughCudnnMatchesCpuReference) {
  MT_REQUIRE_GPU();
  // The production path of GPT-OSS in bf16: cuDNN's forward and backward (with and without the causal band), the
  // backward reading the sinked out and lse (cuDNN forms its row term <dout, out> from the out it is given). The
  // threshold of the bf16 test above (cuDNN also rounds P and dS to bf16: CudaAttentionCudnn's bound).
  constexpr double kThreshold = 2e-2;
  uint64_t seed = 250;
  for (const Case& c : cases()) {
    if (c.hd != 64 || c.hdv != 64) continue;  // cuDNN takes (64, 64), (128, 128), (192, 128)
    int64_t longest = 0;
    for (size_t d = 1; d < c.cu.size(); ++d) longest = std::max<int64_t>(longest, c.cu[d] - c.cu[d - 1]);
    const Inputs in = random_inputs(c, DType::BF16, seed++);
    expect_results_close(run_attention(in, c, gpu(), DType::BF16, longest),
                         run_attention(in, c, Device::cpu(), DType::F32), kThreshold, c.name + " bf16 cuDNN");
  }
}

TEST(CudaAttentionSinks, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  for (const DType dtype : {DType::F32, DType::BF16}) {
    for (const Case& c : {cases()[1], cases()[3]}) {
      const Inputs in = random_inputs(c, dtype, 300);
      const Results a = run_attention(in, c, gpu(), dtype), b = run_attention(in, c, gpu(), dtype);
      const std::string what = c.name + " " + std::string(dtype_name(dtype));
      EXPECT_TRUE(same_bytes(a.out, b.out)) << what << ": out";
      EXPECT_TRUE(same_bytes(a.lse, b.lse)) << what << ": lse";
      EXPECT_TRUE(same_bytes(a.dq, b.dq)) << what << ": dq";
      EXPECT_TRUE(same_bytes(a.dk, b.dk)) << what << ": dk";
      EXPECT_TRUE(same_bytes(a.dv, b.dv)) << what << ": dv";
      EXPECT_TRUE(same_bytes(a.dsinks, b.dsinks)) << what << ": dsinks";
    }
  }
  // The sink ops alone over 313 chunks (the two-pass reduction with more chunks than tree threads), twice.
  const SinkInputs in = random_sink_inputs(20000, 8, 64, DType::BF16, 301);
  const SinkResults a = run_sink_ops(in, gpu(), DType::BF16), b = run_sink_ops(in, gpu(), DType::BF16);
  EXPECT_TRUE(same_bytes(a.out, b.out)) << "sink ops: out";
  EXPECT_TRUE(same_bytes(a.lse, b.lse)) << "sink ops: lse";
  EXPECT_TRUE(same_bytes(a.dsinks, b.dsinks)) << "sink ops: dsinks";
}

TEST(CudaAttentionSinks, RejectsWhatTheKernelsDoNotTake) {
  MT_REQUIRE_GPU();
  Rng rng(500);
  const auto dev = [&](const Shape& shape, DType dtype) {
    return random_tensor(shape, DType::F32, rng).to(dtype).to(gpu());
  };
  Stream& s = default_stream(gpu());
  Tensor out = dev({6, 2, 64}, DType::BF16), lse = dev({6, 2}, DType::F32);
  const Tensor sinks = dev({2}, DType::F32), dout = dev({6, 2, 64}, DType::BF16);
  Tensor dsinks = dev({2}, DType::F32);
  // lse, sinks and dsinks are f32 on CUDA whatever out's dtype.
  expect_error(
      [&] {
        ops::attention_sinks_forward(s, out, dev({6, 2}, DType::BF16), sinks);
      },
      "attention_sinks_forward: lse: expected dtype f32 but found bf16");
  expect_error([&] { ops::attention_sinks_forward(s, out, lse, dev({2}, DType::BF16)); },
               "attention_sinks_forward: sinks: expected dtype f32 but found bf16");
  expect_error([&] { ops::attention_sinks_backward(s, dev({2}, DType::BF16), dout, out, lse, sinks); },
               "attention_sinks_backward: dsinks: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        ops::attention_sinks_backward(s, dsinks, dev({6, 2, 64}, DType::F32), out, lse, sinks);
      },
      "attention_sinks_backward: dout: expected dtype bf16 but found f32");
  // f64 has no CUDA kernel.
  expect_error(
      [&] {
        ops::attention_sinks_forward(s, random_tensor({6, 2, 64}, DType::F64, rng).to(gpu()), lse, sinks);
      },
      "expected out in f32 or bf16 on CUDA");
  // Every tensor on out's device; the stream on it too.
  expect_error([&] { ops::attention_sinks_forward(s, out, lse, sinks.to(Device::cpu())); },
               "attention_sinks_forward: expected sinks on cuda:0 (the device of out)");
  expect_error([&] { ops::attention_sinks_backward(s, dsinks, dout.to(Device::cpu()), out, lse, sinks); },
               "attention_sinks_backward: expected dout on cuda:0 (the device of out)");
  expect_error([&] { ops::attention_sinks_forward(Stream::cpu(), out, lse, sinks); },
               "out is on cuda:0 but the stream runs on cpu");
}

}  // namespace
}  // namespace moetrain
