// Tests for the chunked linear cross-entropy (ops/linear_cross_entropy.*) on the CPU: equality with the unfused ops
// (linear + cross-entropy + their backwards) in f32 for chunk widths that do and do not divide V, one token, one
// chunk wider than V; the gradients against f64 finite differences; ignored targets; row independence; empty
// input; and argument checks.
#include "ops/linear_cross_entropy.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "ops/gemm.h"
#include "ops/loss.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;
using testing::relative_error;

Tensor targets_tensor(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// Targets in [0, V); every third token from the second on is ignored.
Tensor make_targets(int64_t tokens, int64_t vocab, Rng& rng) {
  std::vector<int32_t> t(static_cast<size_t>(tokens));
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = i % 3 == 1 ? ops::kIgnoreIndex : static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return targets_tensor(t);
}

struct Result {
  Tensor losses, lse, dx, dw;
};

// The fused op; dw starts from `dw_start` (so the accumulation is checked too).
Result fused(const Tensor& x, const Tensor& w, const Tensor& targets, double scale, int64_t chunk,
             const Tensor& dw_start) {
  const int64_t T = x.size(0);
  Result r{Tensor::empty({T}, x.dtype()), Tensor::empty({T}, x.dtype()), Tensor::empty(x.shape(), x.dtype()),
           dw_start.clone()};
  ops::linear_cross_entropy_forward_backward(Stream::cpu(), r.losses, r.lse, r.dx, r.dw, x, w, targets, scale, chunk);
  return r;
}

// The unfused path of the model's head: [T, V] logits, cross-entropy, its backward, the linear backwards.
Result unfused(const Tensor& x, const Tensor& w, const Tensor& targets, double scale, const Tensor& dw_start) {
  Stream& s = Stream::cpu();
  const int64_t T = x.size(0);
  Result r{Tensor::empty({T}, x.dtype()), Tensor::empty({T}, x.dtype()), Tensor::empty(x.shape(), x.dtype()),
           dw_start.clone()};
  Tensor logits = Tensor::empty({T, w.size(0)}, x.dtype());
  ops::linear_forward(s, logits, x, w);
  ops::cross_entropy_forward(s, r.losses, r.lse, logits, targets);
  Tensor dlogits = Tensor::empty(logits.shape(), x.dtype());
  ops::cross_entropy_backward(s, dlogits, logits, r.lse, targets, scale);
  ops::linear_backward_input(s, r.dx, dlogits, w);
  ops::linear_backward_weight(s, r.dw, dlogits, x);
  return r;
}

struct Case {
  int64_t tokens, hidden, vocab, chunk;
};

TEST(LinearCrossEntropy, MatchesUnfusedOpsInF32) {
  // V not a multiple of the chunk; one token; a chunk wider than V; V a multiple; one column per chunk.
  const std::vector<Case> cases = {{6, 16, 37, 8}, {1, 8, 20, 7}, {9, 12, 50, 64}, {7, 10, 30, 10}, {4, 6, 9, 1}};
  Rng rng(11);
  for (const Case& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " K " + std::to_string(c.hidden) + " V " + std::to_string(c.vocab) +
                 " chunk " + std::to_string(c.chunk));
    const Tensor x = random_tensor({c.tokens, c.hidden}, DType::F32, rng);
    const Tensor w = random_tensor({c.vocab, c.hidden}, DType::F32, rng, 0.5);
    const Tensor targets = make_targets(c.tokens, c.vocab, rng);
    const Tensor dw_start = random_tensor({c.vocab, c.hidden}, DType::F32, rng);
    const double scale = 1.0 / 3.0;
    const Result a = fused(x, w, targets, scale, c.chunk, dw_start);
    const Result b = unfused(x, w, targets, scale, dw_start);
    // The same f32 logits; only the summation order differs (lse merged over chunks, dx summed chunk by chunk):
    // a few f32 ulps on values of O(1), far below 1e-6 relative.
    EXPECT_LT(relative_error(a.losses, b.losses), 1e-6);
    EXPECT_LT(relative_error(a.lse, b.lse), 1e-6);
    EXPECT_LT(relative_error(a.dx, b.dx), 1e-6);
    EXPECT_LT(relative_error(a.dw, b.dw), 1e-6);
  }
}

TEST(LinearCrossEntropy, OneChunkIsBitwiseTheUnfusedPath) {
  // With V <= chunk there is one chunk, whose logits are reused: the same formulas in the same order.
  Rng rng(12);
  const Tensor x = random_tensor({5, 8}, DType::F32, rng);
  const Tensor w = random_tensor({19, 8}, DType::F32, rng);
  const Tensor targets = targets_tensor({3, ops::kIgnoreIndex, 18, 0, 7});
  const Tensor dw_start = random_tensor({19, 8}, DType::F32, rng);
  const Result a = fused(x, w, targets, 0.25, 19, dw_start);
  const Result b = unfused(x, w, targets, 0.25, dw_start);
  for (const auto& [name, p, q] : {std::tuple{"losses", a.losses, b.losses}, std::tuple{"lse", a.lse, b.lse},
                                   std::tuple{"dx", a.dx, b.dx}, std::tuple{"dw", a.dw, b.dw}}) {
    EXPECT_EQ(std::memcmp(p.raw_data(), q.raw_data(), p.nbytes()), 0) << name;
  }
}

TEST(LinearCrossEntropy, BackwardMatchesFiniteDifferences) {
  Rng rng(13);
  const int64_t T = 5, K = 6, V = 13, chunk = 4;
  Tensor x = random_tensor({T, K}, DType::F64, rng);
  Tensor w = random_tensor({V, K}, DType::F64, rng);
  const Tensor targets = targets_tensor({2, 12, ops::kIgnoreIndex, 0, 5});
  const double scale = 0.3;
  const Result r = fused(x, w, targets, scale, chunk, Tensor::zeros({V, K}, DType::F64));
  auto loss = [&] {
    Tensor losses = Tensor::empty({T}, DType::F64), lse = Tensor::empty({T}, DType::F64);
    ops::linear_cross_entropy_forward(Stream::cpu(), losses, lse, x, w, targets, chunk);
    double sum = 0.0;
    for (int64_t t = 0; t < T; ++t) sum += losses.data<double>()[t];
    return scale * sum;
  };
  testing::expect_gradients_match(loss, {{"x", x, r.dx}, {"w", w, r.dw}});
}

TEST(LinearCrossEntropy, ForwardOnlyGivesTheSameLosses) {
  Rng rng(14);
  const Tensor x = random_tensor({7, 9}, DType::F32, rng);
  const Tensor w = random_tensor({40, 9}, DType::F32, rng);
  const Tensor targets = make_targets(7, 40, rng);
  const Result r = fused(x, w, targets, 0.5, 16, Tensor::zeros({40, 9}, DType::F32));
  Tensor losses = Tensor::empty({7}, DType::F32), lse = Tensor::empty({7}, DType::F32);
  ops::linear_cross_entropy_forward(Stream::cpu(), losses, lse, x, w, targets, 16);
  EXPECT_EQ(std::memcmp(losses.raw_data(), r.losses.raw_data(), losses.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse.raw_data(), r.lse.raw_data(), lse.nbytes()), 0);
}

TEST(LinearCrossEntropy, IgnoredTargetsContributeNothing) {
  Rng rng(15);
  const Tensor x = random_tensor({4, 6}, DType::F32, rng);
  const Tensor w = random_tensor({11, 6}, DType::F32, rng);
  const int32_t ig = ops::kIgnoreIndex;
  const Result r = fused(x, w, targets_tensor({ig, 4, ig, ig}), 1.0, 5, Tensor::zeros({11, 6}, DType::F32));
  for (int64_t t : {0, 2, 3}) {
    EXPECT_EQ(r.losses.data<float>()[t], 0.0f) << "token " << t;
    for (int64_t k = 0; k < 6; ++k) EXPECT_EQ(r.dx.data<float>()[t * 6 + k], 0.0f) << "token " << t << " k " << k;
  }
  EXPECT_GT(r.losses.data<float>()[1], 0.0f);
  // dw only sees token 1: dw = dlogits[1]^T x[1], whose row v is dlogits[1, v] * x[1].
  const Result alone = fused(x.slice(1, 2).clone(), w, targets_tensor({4}), 1.0, 5, Tensor::zeros({11, 6}, DType::F32));
  EXPECT_LT(relative_error(r.dw, alone.dw), 1e-6);
  // Every target ignored: no gradient at all.
  const Tensor dw_start = random_tensor({11, 6}, DType::F32, rng);
  const Result none = fused(x, w, targets_tensor({ig, ig, ig, ig}), 1.0, 5, dw_start);
  EXPECT_EQ(std::memcmp(none.dw.raw_data(), dw_start.raw_data(), dw_start.nbytes()), 0);
  for (float v : none.dx.to_vector<float>()) EXPECT_EQ(v, 0.0f);
}

TEST(LinearCrossEntropy, RowResultsDoNotDependOnOtherRows) {
  Rng rng(16);
  const Tensor x = random_tensor({9, 8}, DType::F32, rng);
  const Tensor w = random_tensor({33, 8}, DType::F32, rng);
  const std::vector<int32_t> all = {5, 1, 32, 0, ops::kIgnoreIndex, 7, 7, 20, 3};
  const Result full = fused(x, w, targets_tensor(all), 0.1, 10, Tensor::zeros({33, 8}, DType::F32));
  const Result part = fused(x.slice(3, 6).clone(), w, targets_tensor({all.begin() + 3, all.begin() + 6}), 0.1, 10,
                            Tensor::zeros({33, 8}, DType::F32));
  EXPECT_EQ(std::memcmp(part.losses.raw_data(), full.losses.slice(3, 6).raw_data(), part.losses.nbytes()), 0);
  EXPECT_EQ(std::memcmp(part.lse.raw_data(), full.lse.slice(3, 6).raw_data(), part.lse.nbytes()), 0);
  EXPECT_EQ(std::memcmp(part.dx.raw_data(), full.dx.slice(3, 6).raw_data(), part.dx.nbytes()), 0);
}

TEST(LinearCrossEntropy, NoTokensLeavesTheWeightGradientAlone) {
  Rng rng(17);
  const Tensor dw_start = random_tensor({7, 4}, DType::F32, rng);
  const Result r = fused(Tensor::empty({0, 4}, DType::F32), random_tensor({7, 4}, DType::F32, rng),
                         Tensor::empty({0}, DType::I32), 1.0, 3, dw_start);
  EXPECT_EQ(r.losses.numel(), 0);
  EXPECT_EQ(std::memcmp(r.dw.raw_data(), dw_start.raw_data(), dw_start.nbytes()), 0);
}

TEST(LinearCrossEntropy, RejectsBadArguments) {
  Rng rng(18);
  const Tensor x = random_tensor({3, 4}, DType::F32, rng);
  const Tensor w = random_tensor({6, 4}, DType::F32, rng);
  const Tensor targets = targets_tensor({0, 5, ops::kIgnoreIndex});
  Tensor losses = Tensor::empty({3}, DType::F32), lse = Tensor::empty({3}, DType::F32);
  Tensor dx = Tensor::empty({3, 4}, DType::F32), dw = Tensor::zeros({6, 4}, DType::F32);
  Stream& s = Stream::cpu();
  auto run = [&](const Tensor& xx, const Tensor& ww, const Tensor& tt, Tensor dxx, Tensor dww, int64_t chunk,
                 double scale) {
    ops::linear_cross_entropy_forward_backward(s, losses, lse, dxx, dww, xx, ww, tt, scale, chunk);
  };
  expect_error([&] { run(x, random_tensor({6, 5}, DType::F32, rng), targets, dx, dw, 2, 1.0); }, "w [V, K = 4]");
  expect_error([&] { run(x, w.to(DType::F64), targets, dx, dw, 2, 1.0); }, "expected w in x's dtype f32");
  expect_error([&] { run(x, w, targets_tensor({0, 6, 1}), dx, dw, 2, 1.0); }, "targets[1] = 6 is outside");
  expect_error([&] { run(x, w, targets_tensor({0, 1}), dx, dw, 2, 1.0); }, "targets");
  expect_error([&] { run(x, w, targets, dx, dw, 0, 1.0); }, "chunk width > 0 but found 0");
  expect_error([&] { run(x, w, targets, Tensor::empty({3, 5}, DType::F32), dw, 2, 1.0); }, "dx");
  expect_error([&] { run(x, w, targets, dx, Tensor::zeros({6, 4}, DType::F64), 2, 1.0); }, "dw");
  expect_error([&] { run(x, w, targets, dx, dw, 2, std::nan("")); }, "finite scale");
  expect_error([&] { run(x.to(DType::BF16), w.to(DType::BF16), targets, dx, dw, 2, 1.0); }, "f32 or f64");
  expect_error([&] { ops::linear_cross_entropy_forward(s, Tensor::empty({3}, DType::F64), lse, x, w, targets, 2); },
               "losses");
}

}  // namespace
}  // namespace moetrain
