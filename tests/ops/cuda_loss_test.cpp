// Tests for the CUDA cross-entropy kernels (ops/cuda/loss.*) through the public ops: forward (losses, lse), backward,
// the fused forward + backward (the two kernels' bytes) and the totals against the CPU reference for f32 and bf16
// logits up to a full 151936-token vocabulary with ignored targets, batch invariance, determinism, the out-of-range
// guard and argument checks. Run on a GPU; skipped elsewhere.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/loss.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/loss.h"
#endif
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

// lse sums V exponentials in f32. The CPU adds them one by one into an accumulator of ~30 (logits of scale 3), which
// rounds every tiny term to the accumulator's ulp (1.9e-6): its own error grows with V, ~1e-7 relative on lse at
// V = 1000 but ~2e-5 at V = 151936 (seen: 1.5e-5), while the GPU's tree of 512 short sums stays near 1e-7. So 1e-5
// up to V = 16k, 1e-4 beyond; and the GPU is also held to 1e-6 against an f64 computation (kF64Tolerance).
double loss_tolerance(int64_t vocab) { return vocab <= 16384 ? 1e-5 : 1e-4; }
// The GPU's lse against the f64 one of the same f32 logits: its f32 rounding, the tree's and expf's errors, ~1e-7.
constexpr double kF64Tolerance = 1e-6;
// dlogits = scale * (exp(x - lse) - onehot) from the same lse: one expf (2 ulp) and two roundings per element.
constexpr double kGradTolerance = 1e-6;
// bf16 gradients are the f32 result rounded to 8 significant bits: up to 2^-9 = 2e-3 relative per element.
constexpr double kBf16Tolerance = 1e-2;

struct Case {
  int64_t tokens;
  int64_t vocab;
};

// A tiny vocabulary, one token, V not a multiple of the block, rows held by clusters of 2 (bf16) and 4 (f32) blocks,
// Qwen's full vocabulary (clusters of 8), no tokens.
const std::vector<Case> kCases = {{5, 7}, {1, 1}, {33, 1000}, {64, 5003}, {12, 40000}, {4, 151936}, {0, 9}};

// Targets in [0, V) with about a fifth of them ignored (the first token always counted when there is one).
Tensor make_targets(int64_t tokens, int64_t vocab, Rng& rng) {
  std::vector<int32_t> targets(static_cast<size_t>(tokens));
  for (size_t t = 0; t < targets.size(); ++t) {
    targets[t] = t > 0 && rng.uniform() < 0.2 ? ops::kIgnoreIndex
                                              : static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  }
  return Tensor::from_vector(targets, {tokens});
}

// lse of every row of host f32 logits, computed in f64 straight from the definition.
Tensor lse_f64(const Tensor& logits) {
  const int64_t tokens = logits.size(0), vocab = logits.size(1);
  const std::vector<float> x = logits.to_vector<float>();
  std::vector<double> lse(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    double m = x[t * vocab];
    for (int64_t v = 1; v < vocab; ++v) m = std::max(m, double(x[t * vocab + v]));
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(x[t * vocab + v]) - m);
    lse[t] = m + std::log(sum);
  }
  return Tensor::from_vector(lse, {tokens});
}

struct Results {
  Tensor losses, lse, dlogits;
  ops::LossTotals totals;
};

// Forward, backward (scale 1 / counted tokens, from the device's own lse) and totals on `device`.
Results run_all(Stream& stream, Device device, const Tensor& logits, const Tensor& targets) {
  const int64_t tokens = logits.size(0);
  const DType row_dtype = device.is_cuda() ? DType::F32 : logits.dtype();
  Results r;
  const Tensor x = logits.to(device), tg = targets.to(device);
  r.losses = Tensor::empty({tokens}, row_dtype, device);
  r.lse = Tensor::empty({tokens}, row_dtype, device);
  ops::cross_entropy_forward(stream, r.losses, r.lse, x, tg);
  r.totals = ops::cross_entropy_totals(stream, r.losses, tg);
  r.dlogits = Tensor::empty(logits.shape(), logits.dtype(), device);
  const double scale = r.totals.count > 0 ? 1.0 / static_cast<double>(r.totals.count) : 1.0;
  ops::cross_entropy_backward(stream, r.dlogits, x, r.lse, tg, scale);
  return r;
}

TEST(CudaCrossEntropy, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " V " << c.vocab);
    Rng rng(71);
    const Tensor logits = random_tensor({c.tokens, c.vocab}, DType::F32, rng, 3.0);
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Results want = run_all(Stream::cpu(), Device::cpu(), logits, targets);
    const Results got = run_all(gpu(), Device::cuda(0), logits, targets);
    const double e_loss = relative_error(host_f32(got.losses), want.losses);
    const double e_lse = relative_error(host_f32(got.lse), want.lse);
    const double e_lse64 = relative_error(host_f32(got.lse), lse_f64(logits));
    EXPECT_LT(e_loss, loss_tolerance(c.vocab)) << "losses";
    EXPECT_LT(e_lse, loss_tolerance(c.vocab)) << "lse";
    EXPECT_LT(e_lse64, kF64Tolerance) << "lse against f64";
    // The count is exact; the f64 sums of the same kind of f32 losses differ by the losses' own errors only.
    EXPECT_EQ(got.totals.count, want.totals.count);
    EXPECT_NEAR(got.totals.sum, want.totals.sum, loss_tolerance(c.vocab) * std::fabs(want.totals.sum));
    // The backward on its own: both sides from the CPU's lse.
    Tensor d_cpu = Tensor::empty({c.tokens, c.vocab}, DType::F32);
    const double scale = 0.37;
    ops::cross_entropy_backward(Stream::cpu(), d_cpu, logits, want.lse, targets, scale);
    Tensor d_gpu = Tensor::empty({c.tokens, c.vocab}, DType::F32, Device::cuda(0));
    ops::cross_entropy_backward(gpu(), d_gpu, on_gpu(logits), on_gpu(want.lse), on_gpu(targets), scale);
    const double e_grad = relative_error(host_f32(d_gpu), d_cpu);
    EXPECT_LT(e_grad, kGradTolerance) << "dlogits";
    std::printf("cross entropy f32 T %lld V %lld: rel err losses %.2e lse %.2e (vs f64 %.2e) dlogits %.2e\n",
                static_cast<long long>(c.tokens), static_cast<long long>(c.vocab), e_loss, e_lse, e_lse64, e_grad);
  }
}

TEST(CudaCrossEntropy, Bf16LogitsMatchCpuOnTheRoundedValues) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " V " << c.vocab);
    Rng rng(72);
    const Tensor logits16 = random_tensor({c.tokens, c.vocab}, DType::F32, rng, 3.0).to(DType::BF16);
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Results want = run_all(Stream::cpu(), Device::cpu(), logits16.to(DType::F32), targets);
    const Results got = run_all(gpu(), Device::cuda(0), logits16, targets);
    // losses and lse are f32 outputs computed in f32 from exact inputs: the f32 bound holds.
    EXPECT_LT(relative_error(host_f32(got.losses), want.losses), loss_tolerance(c.vocab)) << "losses";
    EXPECT_LT(relative_error(host_f32(got.lse), want.lse), loss_tolerance(c.vocab)) << "lse";
    EXPECT_LT(relative_error(host_f32(got.lse), lse_f64(logits16.to(DType::F32))), kF64Tolerance) << "lse against f64";
    EXPECT_EQ(got.totals.count, want.totals.count);
    ASSERT_EQ(got.dlogits.dtype(), DType::BF16);
    EXPECT_LT(relative_error(host_f32(got.dlogits), want.dlogits), kBf16Tolerance) << "dlogits (bf16)";
  }
}

TEST(CudaCrossEntropy, RowResultsDoNotDependOnOtherRowsAndRepeatExactly) {
  MT_REQUIRE_GPU();
  Rng rng(73);
  const int64_t vocab = 32000;
  const Tensor logits = random_tensor({50, vocab}, DType::F32, rng, 2.0);
  const Tensor targets = make_targets(50, vocab, rng);
  const Results all = run_all(gpu(), Device::cuda(0), logits, targets);
  const Results again = run_all(gpu(), Device::cuda(0), logits, targets);
  EXPECT_TRUE(same_bytes(all.losses, again.losses)) << "losses";
  EXPECT_TRUE(same_bytes(all.lse, again.lse)) << "lse";
  EXPECT_TRUE(same_bytes(all.dlogits, again.dlogits)) << "dlogits";
  EXPECT_EQ(all.totals.sum, again.totals.sum);
  // Row 0 alone: the same losses and lse bits (its gradient's scale depends on the count, so compare the forward).
  Tensor losses = Tensor::empty({1}, DType::F32, Device::cuda(0));
  Tensor lse = Tensor::empty({1}, DType::F32, Device::cuda(0));
  ops::cross_entropy_forward(gpu(), losses, lse, on_gpu(logits.slice(0, 1).clone()),
                             on_gpu(targets.slice(0, 1).clone()));
  EXPECT_TRUE(same_bytes(losses, all.losses.to(Device::cpu()).slice(0, 1).clone())) << "loss of row 0";
  EXPECT_TRUE(same_bytes(lse, all.lse.to(Device::cpu()).slice(0, 1).clone())) << "lse of row 0";
}

TEST(CudaCrossEntropy, BackwardInPlaceGivesTheBitsOfASeparateGradient) {
  MT_REQUIRE_GPU();
  // The model's head overwrites the logits with their gradient: every element is read before it is written, in
  // 16-byte packs (V = 1000 and 151936) and one element at a time (V = 5003, an odd row length in bf16).
  for (const Case& c : {Case{33, 1000}, Case{64, 5003}, Case{4, 151936}}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(::testing::Message() << c.tokens << " x " << c.vocab << " " << dtype_name(dtype));
      Rng rng(74);
      const Tensor logits = on_gpu(random_tensor({c.tokens, c.vocab}, DType::F32, rng, 2.0).to(dtype));
      const Tensor targets = on_gpu(make_targets(c.tokens, c.vocab, rng));
      Tensor losses = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
      Tensor lse = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
      ops::cross_entropy_forward(gpu(), losses, lse, logits, targets);
      Tensor separate = Tensor::empty(logits.shape(), dtype, Device::cuda(0));
      ops::cross_entropy_backward(gpu(), separate, logits, lse, targets, 0.25);
      Tensor in_place = logits.clone();
      ops::cross_entropy_backward(gpu(), in_place, in_place, lse, targets, 0.25);
      EXPECT_TRUE(same_bytes(in_place, separate));
    }
  }
}

TEST(CudaCrossEntropy, ForwardBackwardGivesTheBitsOfTheTwoKernels) {
  MT_REQUIRE_GPU();
  // The fused kernel against the forward and the backward kernels: the same losses, lse and gradient bytes, into a
  // separate gradient and in place, for rows held in registers by clusters of 1 (V = 1000, with more rows than SMs),
  // 2 or 4 (V = 40000) and 8 blocks (V = 151936), and for the one-block kernel (two blocks per SM, rows
  // grid-strided, the gradient pass walking each row backwards) on rows element by element (V = 5003 in bf16, V = 7)
  // and on packed rows too long to hold (V = 600000; the limit is 327,680 bf16 or 163,840 f32 logits).
  for (const Case& c : {Case{5, 7}, Case{1, 1}, Case{300, 1000}, Case{64, 5003}, Case{12, 40000}, Case{4, 151936},
                        Case{3, 600000}, Case{0, 9}}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(::testing::Message() << c.tokens << " x " << c.vocab << " " << dtype_name(dtype));
      Rng rng(75);
      const Tensor logits = on_gpu(random_tensor({c.tokens, c.vocab}, DType::F32, rng, 2.0).to(dtype));
      const Tensor targets = on_gpu(make_targets(c.tokens, c.vocab, rng));
      Tensor losses = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
      Tensor lse = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
      ops::cross_entropy_forward(gpu(), losses, lse, logits, targets);
      Tensor gradient = Tensor::empty(logits.shape(), dtype, Device::cuda(0));
      ops::cross_entropy_backward(gpu(), gradient, logits, lse, targets, 0.25);
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(in_place ? "in place" : "separate gradient");
        Tensor fused_losses = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
        Tensor fused_lse = Tensor::empty({c.tokens}, DType::F32, Device::cuda(0));
        Tensor input = logits.clone();
        Tensor fused_gradient = in_place ? input : Tensor::empty(logits.shape(), dtype, Device::cuda(0));
        ops::cross_entropy_forward_backward(gpu(), fused_losses, fused_lse, fused_gradient, input, targets, 0.25);
        EXPECT_TRUE(same_bytes(fused_losses, losses)) << "losses";
        EXPECT_TRUE(same_bytes(fused_lse, lse)) << "lse";
        EXPECT_TRUE(same_bytes(fused_gradient, gradient)) << "gradient";
      }
    }
  }
}

TEST(CudaCrossEntropy, TotalsOfManyTokensMatchCpu) {
  MT_REQUIRE_GPU();
  // Sums of f32 losses in f64: the orders differ (ascending vs a fixed tree), each addition errs by ~1e-16 relative.
  Rng rng(74);
  const int64_t tokens = 100003;
  const Tensor losses = random_tensor({tokens}, DType::F32, rng, 3.0);
  const Tensor targets = make_targets(tokens, 100, rng);
  const ops::LossTotals want = ops::cross_entropy_totals(Stream::cpu(), losses, targets);
  const ops::LossTotals got = ops::cross_entropy_totals(gpu(), on_gpu(losses), on_gpu(targets));
  EXPECT_EQ(got.count, want.count);
  EXPECT_NEAR(got.sum, want.sum, 1e-12 * std::fabs(want.sum) + 1e-12);
  const ops::LossTotals again = ops::cross_entropy_totals(gpu(), on_gpu(losses), on_gpu(targets));
  EXPECT_EQ(again.sum, got.sum);
}

TEST(CudaCrossEntropy, PendingTotalsReadTogetherHaveTheBitsOfEachReadAlone) {
  MT_REQUIRE_GPU();
  // A step leaves each micro-batch's totals on the device and reads them at its end in one copy: the values of each
  // read alone, in order, whatever the micro-batch sizes (one token, none counted, many).
  Rng rng(75);
  std::vector<Tensor> pending;
  std::vector<ops::LossTotals> alone;
  for (const int64_t tokens : {int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{33}}) {
    const Tensor losses = on_gpu(random_tensor({tokens}, DType::F32, rng, 3.0));
    const Tensor targets = on_gpu(tokens == 7 ? Tensor::from_vector(std::vector<int32_t>(7, ops::kIgnoreIndex), {7})
                                              : make_targets(tokens, 100, rng));
    alone.push_back(ops::cross_entropy_totals(gpu(), losses, targets));
    pending.push_back(ops::cross_entropy_totals_pending(gpu(), losses, targets));
  }
  const std::vector<ops::LossTotals> together = ops::read_loss_totals(gpu(), pending);
  ASSERT_EQ(together.size(), alone.size());
  for (size_t i = 0; i < alone.size(); ++i) {
    EXPECT_EQ(together[i].sum, alone[i].sum) << i;
    EXPECT_EQ(together[i].count, alone[i].count) << i;
  }
  EXPECT_EQ(together[1].count, 0);
  EXPECT_EQ(together[1].sum, 0.0);
  expect_error([&] { ops::read_loss_totals(gpu(), {Tensor::zeros({3}, DType::F64, Device::cuda(0))}); },
               {"read_loss_totals", "f64 [2]", "entry 0"});
}

TEST(CudaCrossEntropy, TargetOutsideTheVocabularyGivesNanInsteadOfAnOutOfBoundsRead) {
  MT_REQUIRE_GPU();
  // The device cannot report a bad target (the trainer validates batches on the host): the row turns NaN. Rows held by
  // one block (V = 4) and by a cluster of 4 (V = 40000), through the forward, the backward and the fused op.
  for (const int64_t vocab : {int64_t{4}, int64_t{40000}}) {
    SCOPED_TRACE(::testing::Message() << "V " << vocab);
    const Tensor logits = on_gpu(Tensor::zeros({3, vocab}, DType::F32));
    const Tensor targets =
        on_gpu(Tensor::from_vector(std::vector<int32_t>{1, static_cast<int32_t>(vocab), ops::kIgnoreIndex}, {3}));
    Tensor losses = Tensor::empty({3}, DType::F32, Device::cuda(0));
    Tensor lse = Tensor::empty({3}, DType::F32, Device::cuda(0));
    ops::cross_entropy_forward(gpu(), losses, lse, logits, targets);
    const std::vector<float> l = host_f32(losses).to_vector<float>();
    EXPECT_NEAR(l[0], std::log(static_cast<float>(vocab)), 1e-5f);
    EXPECT_TRUE(std::isnan(l[1])) << l[1];
    EXPECT_EQ(l[2], 0.0f);
    Tensor dlogits = Tensor::empty({3, vocab}, DType::F32, Device::cuda(0));
    ops::cross_entropy_backward(gpu(), dlogits, logits, lse, targets, 1.0);
    Tensor fused_losses = Tensor::empty({3}, DType::F32, Device::cuda(0));
    Tensor fused_lse = Tensor::empty({3}, DType::F32, Device::cuda(0));
    Tensor fused = logits.clone();
    ops::cross_entropy_forward_backward(gpu(), fused_losses, fused_lse, fused, fused, targets, 1.0);
    EXPECT_TRUE(same_bytes(fused_losses, losses)) << "fused losses";
    for (const Tensor* gradient : {&dlogits, &fused}) {
      const std::vector<float> d = host_f32(*gradient).to_vector<float>();
      const float p = 1.0f / static_cast<float>(vocab);
      EXPECT_NEAR(d[1], p - 1.0f, 1e-6f) << "row 0's target";
      for (int64_t v = 0; v < vocab; ++v) {
        if (v != 1 && std::fabs(d[v] - p) > 1e-6f) ADD_FAILURE() << "row 0 column " << v << ": " << d[v];
        if (!std::isnan(d[vocab + v])) ADD_FAILURE() << "row 1 column " << v << ": " << d[vocab + v];
        if (d[2 * vocab + v] != 0.0f) ADD_FAILURE() << "ignored row 2 column " << v << ": " << d[2 * vocab + v];
      }
    }
  }
}

TEST(CudaCrossEntropy, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  const Tensor logits16 = Tensor::zeros({3, 5}, DType::BF16, cuda);
  const Tensor targets = Tensor::zeros({3}, DType::I32, cuda);
  Tensor losses16 = Tensor::zeros({3}, DType::BF16, cuda);
  Tensor lse = Tensor::zeros({3}, DType::F32, cuda);
  expect_error([&] { ops::cross_entropy_forward(gpu(), losses16, lse, logits16, targets); },
               {"cross_entropy_forward: losses", "expected dtype f32", "bf16"});
  Tensor dlogits32 = Tensor::zeros({3, 5}, DType::F32, cuda);
  expect_error([&] { ops::cross_entropy_backward(gpu(), dlogits32, logits16, lse, targets, 1.0); },
               {"cross_entropy_backward: dlogits", "expected dtype bf16", "f32"});
  expect_error([&] { ops::cross_entropy_totals(gpu(), Tensor::zeros({3}, DType::F64, cuda), targets); },
               {"cross_entropy_totals", "losses", "f32", "f64"});
  expect_error(
      [&] { ops::cross_entropy_totals(gpu(), Tensor::zeros({3}, DType::F32, cuda), Tensor::zeros({3}, DType::I32)); },
      {"cross_entropy_totals", "targets", "stream's device cuda:0", "on cpu"});
}

#if MOETRAIN_HAS_CUDA
// The shapes the tests above count on (a host function: runs without a GPU): which rows clusters of 1, 2, 4 and 8
// blocks hold, the first row length too long to hold (8 ranks x 512 threads x 10 packs), and rows not in packs.
TEST(CrossEntropyHeldRows, ShapeFollowsFromTheRowLengthAlone) {
  struct Expected {
    int64_t vocab;
    int pack;  // 8: bf16, 4: f32
    int ranks, threads;
  };
  for (const Expected& e : {Expected{7 * 8, 8, 1, 32}, Expected{1000, 8, 1, 32}, Expected{1000, 4, 1, 32},
                            Expected{32000, 4, 4, 224}, Expected{40000, 8, 2, 256}, Expected{40000, 4, 4, 256},
                            Expected{102400, 8, 4, 320}, Expected{151936, 8, 8, 256}, Expected{151936, 4, 8, 480},
                            Expected{201088, 8, 8, 320}, Expected{327680, 8, 8, 512}, Expected{163840, 4, 8, 512},
                            Expected{327688, 8, 0, 0}, Expected{163844, 4, 0, 0}, Expected{600000, 8, 0, 0}}) {
    SCOPED_TRACE(::testing::Message() << "V " << e.vocab << " in packs of " << e.pack);
    const ops::cuda::HeldRowShape shape = ops::cuda::held_row_shape(/*packed=*/true, e.vocab, e.pack);
    EXPECT_EQ(shape.ranks, e.ranks);
    EXPECT_EQ(shape.threads, e.threads);
  }
  EXPECT_EQ(ops::cuda::held_row_shape(/*packed=*/false, 5003, 8).ranks, 0);
}

// Benchmark: one micro-batch of the workload of record's loss (8192 tokens, Qwen's 151,936-token vocabulary, bf16
// logits, 2.5 GB): the forward and the in-place backward kernels against the fused kernel, in ms and in bytes of
// logits moved per second (three passes for the two kernels, two for the fused one).
TEST(CudaCrossEntropyBench, DISABLED_WorkloadShape) {
  MT_REQUIRE_GPU();
  constexpr int64_t kTokens = 8192, kVocab = 151936;
  const Device dev = Device::cuda(0);
  Rng rng(76);
  const Tensor row = random_tensor({kVocab}, DType::F32, rng, 2.0).to(DType::BF16);
  Tensor logits = Tensor::empty({kTokens, kVocab}, DType::BF16, dev);
  for (int64_t t = 0; t < kTokens; ++t) {
    copy_bytes(static_cast<uint8_t*>(logits.raw_data()) + t * kVocab * 2, dev, row.raw_data(), Device::cpu(),
               static_cast<size_t>(kVocab) * 2);
  }
  const Tensor targets = on_gpu(make_targets(kTokens, kVocab, rng));
  Tensor losses = Tensor::empty({kTokens}, DType::F32, dev), lse = Tensor::empty({kTokens}, DType::F32, dev);
  const double pass_bytes = static_cast<double>(kTokens) * kVocab * 2;
  const auto time_ms = [&](const std::function<void()>& call) {
    call();
    ops::cuda::synchronize(dev);
    constexpr int kReps = 10;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) call();
    ops::cuda::synchronize(dev);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kReps;
  };
  const double two_kernels = time_ms([&] {
    ops::cross_entropy_forward(gpu(), losses, lse, logits, targets);
    ops::cross_entropy_backward(gpu(), logits, logits, lse, targets, 1e-4);
  });
  std::printf("[cross-entropy] %lld x %lld bf16: forward + backward kernels %.3f ms (%.0f GB/s over 3 passes)\n",
              static_cast<long long>(kTokens), static_cast<long long>(kVocab), two_kernels,
              3 * pass_bytes / two_kernels / 1e6);
  const double fused =
      time_ms([&] { ops::cross_entropy_forward_backward(gpu(), losses, lse, logits, logits, targets, 1e-4); });
  std::printf("[cross-entropy] fused: %.3f ms (%.0f GB/s over 2 passes; x%.2f)\n", fused, 2 * pass_bytes / fused / 1e6,
              two_kernels / fused);
}
#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace moetrain
