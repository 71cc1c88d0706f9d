// Tests for the CUDA chunked linear cross-entropy (ops/cuda/linear_cross_entropy.* behind ops/linear_cross_entropy.h)
// through the public ops: f32 against the CPU reference (the same op on CPU tensors) and against the unfused CUDA
// path (linear + cross-entropy + backwards), up to Qwen's 151936-token vocabulary, V not a multiple of the chunk,
// one token, no tokens; bf16 inputs against the CPU on the rounded values and against the unfused bf16 path; ignored
// and out-of-range targets; determinism. Every comparison prints its measured error. Run on a GPU; skipped elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/gemm.h"
#include "ops/linear_cross_entropy.h"
#include "ops/loss.h"
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
  int64_t tokens, hidden, vocab, chunk;
};

// V not a multiple of the chunk; one token; mid sizes; a realistic chunk over Qwen's full vocabulary; no tokens.
const std::vector<Case> kCases = {{5, 16, 37, 8},         {1, 32, 1000, 256},     {64, 128, 5003, 1024},
                                  {96, 256, 20000, 4096}, {16, 64, 151936, 8192}, {0, 16, 9, 4}};

std::string describe(const Case& c) {
  return "T " + std::to_string(c.tokens) + " K " + std::to_string(c.hidden) + " V " + std::to_string(c.vocab) +
         " chunk " + std::to_string(c.chunk);
}

// f32 tolerances. The CPU and cuBLASLt sum in different orders: the logits (length-K dot products) differ by a few
// ulps, the lse (sums of <= chunk exponentials, the CPU's own rounding grows with the chunk: ~1e-6 at 8192, see
// cuda_loss_test) too, and dx (a length-V reduction over chunk GEMMs) and dw (length T) differ by ~u sqrt(length).
// 2e-5, or 4 u sqrt(length) when larger, leaves margin without hiding a wrong term (which costs ~1 / sqrt(length)).
double f32_tolerance(int64_t length) { return std::max(2e-5, 4.0 * 0x1p-24 * std::sqrt(double(length))); }
// bf16 inputs: the GPU rounds each logits chunk to bf16 (as the unfused path rounds the logits) and the gradient
// chunk too; the CPU reference on the same bf16-valued inputs keeps f32. With logits of std 1 (|l| < 4 in practice,
// bf16 ulp <= 2^-6) a logit moves by ~0.45% rms of an ulp-scaled step, i.e. each p by ~0.5%, the loss (~log V) by
// ~1e-3 relative; dx / dw inherit ~0.5% plus their own bf16 / f32 rounding. Thresholds: 1e-2 for losses / lse, 2e-2
// for dx / dw (about 4x the estimate).
constexpr double kBf16LossTolerance = 1e-2;
constexpr double kBf16GradTolerance = 2e-2;

struct Result {
  Tensor losses, lse, dx, dw;
};

// Targets in [0, V) with every third token from the second on ignored.
Tensor make_targets(int64_t tokens, int64_t vocab, Rng& rng) {
  std::vector<int32_t> t(static_cast<size_t>(tokens));
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = i % 3 == 1 ? ops::kIgnoreIndex : static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector(t, {tokens});
}

// The fused op on the device of `stream`; inputs copied there; dw starts from dw_start (f32).
Result fused(Stream& stream, const Tensor& x, const Tensor& w, const Tensor& targets, double scale, int64_t chunk,
             const Tensor& dw_start) {
  const Device d = stream.device();
  const DType rows = d.is_cuda() ? DType::F32 : x.dtype();
  const int64_t T = x.size(0);
  Result r{Tensor::empty({T}, rows, d), Tensor::empty({T}, rows, d), Tensor::empty(x.shape(), x.dtype(), d),
           d.is_cpu() ? dw_start.clone() : dw_start.to(d)};
  ops::linear_cross_entropy_forward_backward(stream, r.losses, r.lse, r.dx, r.dw, x.to(d), w.to(d), targets.to(d),
                                             scale, chunk);
  return r;
}

// The unfused CUDA path of the model's head on the GPU.
Result unfused_gpu(const Tensor& x_host, const Tensor& w_host, const Tensor& targets_host, double scale,
                   const Tensor& dw_start) {
  Stream& s = gpu();
  const Device d = Device::cuda(0);
  const Tensor x = on_gpu(x_host), w = on_gpu(w_host), targets = on_gpu(targets_host);
  const int64_t T = x.size(0);
  Result r{Tensor::empty({T}, DType::F32, d), Tensor::empty({T}, DType::F32, d), Tensor::empty(x.shape(), x.dtype(), d),
           on_gpu(dw_start)};
  Tensor logits = Tensor::empty({T, w.size(0)}, x.dtype(), d);
  ops::linear_forward(s, logits, x, w);
  ops::cross_entropy_forward(s, r.losses, r.lse, logits, targets);
  Tensor dlogits = Tensor::empty(logits.shape(), x.dtype(), d);
  ops::cross_entropy_backward(s, dlogits, logits, r.lse, targets, scale);
  ops::linear_backward_input(s, r.dx, dlogits, w);
  ops::linear_backward_weight(s, r.dw, dlogits, x);
  return r;
}

// ||got - want|| / ||want|| <= tolerance, printed for the lead, with the max abs difference on failure.
void expect_close(const Tensor& got, const Tensor& want, double tolerance, const std::string& what) {
  const Tensor g = host_f32(got), w = host_f32(want);
  const double err = relative_error(g, w);
  std::printf("    %-60s relative error %.3e (threshold %.1e)\n", what.c_str(), err, tolerance);
  EXPECT_LE(err, tolerance) << what << ": ||gpu - ref|| / ||ref|| = " << err
                            << ", max |gpu - ref| = " << testing::max_abs_diff(g, w);
}

void expect_all_close(const Result& got, const Result& want, const Case& c, double loss_tol, double dx_tol,
                      double dw_tol, const std::string& label) {
  const std::string name = label + " " + describe(c);
  if (c.tokens == 0) {
    EXPECT_TRUE(same_bytes(got.dw, want.dw)) << name << ": dw changed with no tokens";
    return;
  }
  expect_close(got.losses, want.losses, loss_tol, name + " losses");
  expect_close(got.lse, want.lse, loss_tol, name + " lse");
  expect_close(got.dx, want.dx, dx_tol, name + " dx");
  expect_close(got.dw, want.dw, dw_tol, name + " dw");
}

TEST(CudaLinearCrossEntropy, F32MatchesCpuReference) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    Rng rng(91);
    const Tensor x = random_tensor({c.tokens, c.hidden}, DType::F32, rng);
    // w of std 3 / sqrt(K): logits of std ~3, as in cuda_loss_test.
    const Tensor w = random_tensor({c.vocab, c.hidden}, DType::F32, rng, 3.0 / std::sqrt(double(c.hidden)));
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Tensor dw_start = random_tensor({c.vocab, c.hidden}, DType::F32, rng, 1e-3);
    const double scale = 1.0 / 7.0;
    const Result want = fused(Stream::cpu(), x, w, targets, scale, c.chunk, dw_start);
    const Result got = fused(gpu(), x, w, targets, scale, c.chunk, dw_start);
    expect_all_close(got, want, c, f32_tolerance(c.hidden), f32_tolerance(c.vocab), f32_tolerance(c.tokens),
                     "f32 gpu vs cpu");
  }
}

TEST(CudaLinearCrossEntropy, F32MatchesUnfusedCudaPath) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    Rng rng(92);
    const Tensor x = random_tensor({c.tokens, c.hidden}, DType::F32, rng);
    const Tensor w = random_tensor({c.vocab, c.hidden}, DType::F32, rng, 3.0 / std::sqrt(double(c.hidden)));
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Tensor dw_start = Tensor::zeros({c.vocab, c.hidden}, DType::F32);
    const double scale = 0.01;
    const Result want = unfused_gpu(x, w, targets, scale, dw_start);
    const Result got = fused(gpu(), x, w, targets, scale, c.chunk, dw_start);
    expect_all_close(got, want, c, f32_tolerance(c.hidden), f32_tolerance(c.vocab), f32_tolerance(c.tokens),
                     "f32 fused vs unfused");
  }
}

TEST(CudaLinearCrossEntropy, Bf16MatchesCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    Rng rng(93);
    // Logits of std ~1 (see kBf16GradTolerance).
    const Tensor x16 = random_tensor({c.tokens, c.hidden}, DType::F32, rng).to(DType::BF16);
    const Tensor w16 =
        random_tensor({c.vocab, c.hidden}, DType::F32, rng, 1.0 / std::sqrt(double(c.hidden))).to(DType::BF16);
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Tensor dw_start = Tensor::zeros({c.vocab, c.hidden}, DType::F32);
    const double scale = 1.0 / 5.0;
    const Result want = fused(Stream::cpu(), x16.to(DType::F32), w16.to(DType::F32), targets, scale, c.chunk, dw_start);
    const Result got = fused(gpu(), x16, w16, targets, scale, c.chunk, dw_start);
    EXPECT_EQ(got.dx.dtype(), DType::BF16);
    EXPECT_EQ(got.dw.dtype(), DType::F32);
    expect_all_close(got, want, c, kBf16LossTolerance, kBf16GradTolerance, kBf16GradTolerance, "bf16 gpu vs cpu");
  }
}

TEST(CudaLinearCrossEntropy, Bf16MatchesUnfusedCudaPath) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    Rng rng(94);
    const Tensor x16 = random_tensor({c.tokens, c.hidden}, DType::F32, rng).to(DType::BF16);
    const Tensor w16 =
        random_tensor({c.vocab, c.hidden}, DType::F32, rng, 1.0 / std::sqrt(double(c.hidden))).to(DType::BF16);
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Tensor dw_start = Tensor::zeros({c.vocab, c.hidden}, DType::F32);
    const Result want = unfused_gpu(x16, w16, targets, 0.125, dw_start);
    const Result got = fused(gpu(), x16, w16, targets, 0.125, c.chunk, dw_start);
    // Both round the logits and their gradient to bf16; they differ by the GEMMs' orders (one bf16 ulp here and
    // there) and by dx's rounding (once from an f32 accumulator here, once from one long GEMM there): 1e-2.
    expect_all_close(got, want, c, kBf16LossTolerance, kBf16LossTolerance, kBf16LossTolerance, "bf16 fused vs unfused");
  }
}

TEST(CudaLinearCrossEntropy, IgnoredAndOutOfRangeTargets) {
  MT_REQUIRE_GPU();
  Rng rng(95);
  const int64_t T = 4, K = 32, V = 300, chunk = 128;
  const Tensor x = random_tensor({T, K}, DType::F32, rng);
  const Tensor w = random_tensor({V, K}, DType::F32, rng, 0.2);
  // Token 0 counted, 1 ignored, 2 outside [0, V) (not validated on the device: NaN loss and NaN dx row), 3 counted.
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>{7, ops::kIgnoreIndex, int32_t(V + 3), 299}, {T});
  const Result r = fused(gpu(), x, w, targets, 1.0, chunk, Tensor::zeros({V, K}, DType::F32));
  const std::vector<float> losses = host_f32(r.losses).to_vector<float>();
  const std::vector<float> dx = host_f32(r.dx).to_vector<float>();
  EXPECT_TRUE(std::isfinite(losses[0]) && losses[0] > 0.0f) << "loss[0] = " << losses[0];
  EXPECT_EQ(losses[1], 0.0f) << "an ignored target's loss";
  EXPECT_TRUE(std::isnan(losses[2])) << "an out-of-range target's loss should be NaN, found " << losses[2];
  EXPECT_TRUE(std::isfinite(losses[3]) && losses[3] > 0.0f) << "loss[3] = " << losses[3];
  for (int64_t k = 0; k < K; ++k) {
    EXPECT_EQ(dx[1 * K + k], 0.0f) << "ignored token's dx, k " << k;
    EXPECT_TRUE(std::isnan(dx[2 * K + k])) << "out-of-range token's dx, k " << k << ": " << dx[2 * K + k];
    EXPECT_TRUE(std::isfinite(dx[0 * K + k]) && std::isfinite(dx[3 * K + k])) << "counted tokens' dx, k " << k;
  }
}

TEST(CudaLinearCrossEntropy, IsDeterministic) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(96);
    const int64_t T = 128, K = 256, V = 20000, chunk = 4096;
    const Tensor x = random_tensor({T, K}, DType::F32, rng).to(dtype);
    const Tensor w = random_tensor({V, K}, DType::F32, rng, 1.0 / 16.0).to(dtype);
    const Tensor targets = make_targets(T, V, rng);
    const Tensor dw_start = Tensor::zeros({V, K}, DType::F32);
    const Result a = fused(gpu(), x, w, targets, 0.5, chunk, dw_start);
    const Result b = fused(gpu(), x, w, targets, 0.5, chunk, dw_start);
    EXPECT_TRUE(same_bytes(a.losses, b.losses)) << "losses differ between two runs";
    EXPECT_TRUE(same_bytes(a.lse, b.lse)) << "lse differs between two runs";
    EXPECT_TRUE(same_bytes(a.dx, b.dx)) << "dx differs between two runs";
    EXPECT_TRUE(same_bytes(a.dw, b.dw)) << "dw differs between two runs";
  }
}

TEST(CudaLinearCrossEntropy, RejectsDtypesTheCudaPathLacks) {
  MT_REQUIRE_GPU();
  Rng rng(97);
  const Tensor x = on_gpu(random_tensor({3, 4}, DType::F64, rng));
  const Tensor w = on_gpu(random_tensor({6, 4}, DType::F64, rng));
  const Tensor targets = on_gpu(Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3}));
  const Device d = Device::cuda(0);
  testing::expect_error(
      [&] {
        ops::linear_cross_entropy_forward(gpu(), Tensor::empty({3}, DType::F32, d), Tensor::empty({3}, DType::F32, d),
                                          x, w, targets, 2);
      },
      {"f32 or bf16 (CUDA)"});
  testing::expect_error(
      [&] {
        ops::linear_cross_entropy_forward_backward(
            gpu(), Tensor::empty({3}, DType::F32, d), Tensor::empty({3}, DType::F32, d),
            Tensor::empty({3, 4}, DType::BF16, d), Tensor::zeros({6, 4}, DType::BF16, d),
            on_gpu(random_tensor({3, 4}, DType::F32, rng).to(DType::BF16)),
            on_gpu(random_tensor({6, 4}, DType::F32, rng).to(DType::BF16)), targets, 1.0, 2);
      },
      {"dw"});
}

}  // namespace
}  // namespace moetrain
