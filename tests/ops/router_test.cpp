// Tests for ops/router: softmax and top-k selection (hand case with ties, direct computation), backward against
// finite differences with and without renormalisation and with a gradient on the full probabilities, per-token
// independence, and argument checks.
#include "ops/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::random_tensor;
using testing::relative_error;

struct Routed {
  Tensor probs, topk_index, topk_weight;
};

Routed route(const Tensor& logits, const ops::RouterParams& params) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Routed r{Tensor::empty({tokens, experts}, logits.dtype()), Tensor::empty({tokens, params.top_k}, DType::I32),
           Tensor::empty({tokens, params.top_k}, logits.dtype())};
  ops::router_forward(Stream::cpu(), r.probs, r.topk_index, r.topk_weight, logits, params);
  return r;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected a moetrain::Error containing \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Logits whose experts are at least `gap` apart within each token (a shuffled ladder plus small noise), so a
// finite-difference step never changes the top-k selection.
Tensor separated_logits(int64_t tokens, int64_t experts, double gap, Rng& rng) {
  Tensor t = Tensor::empty({tokens, experts}, DType::F64);
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < tokens; ++r) {
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = experts - 1; i > 0; --i) {
      std::swap(order[static_cast<size_t>(i)], order[rng.below(static_cast<uint64_t>(i + 1))]);
    }
    for (int64_t e = 0; e < experts; ++e) {
      t.data<double>()[r * experts + e] =
          gap * (static_cast<double>(order[static_cast<size_t>(e)]) - experts / 2.0) + 0.2 * gap * rng.uniform();
    }
  }
  return t;
}

TEST(Router, ForwardHandCaseBreaksTiesByLowerExpertIndex) {
  const Tensor logits = Tensor::from_vector<float>({1, 3, 3, 0,  //
                                                    2, 0, 2, 2},
                                                   {2, 4});
  for (bool renormalize : {false, true}) {
    const Routed r = route(logits, {2, renormalize});
    EXPECT_EQ(r.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 0, 2}));
    const double z0 = std::exp(1.0) + 2 * std::exp(3.0) + 1.0, z1 = 3 * std::exp(2.0) + 1.0;
    const std::vector<double> probs{std::exp(1.0) / z0, std::exp(3.0) / z0, std::exp(3.0) / z0, 1.0 / z0,
                                    std::exp(2.0) / z1, 1.0 / z1,           std::exp(2.0) / z1, std::exp(2.0) / z1};
    EXPECT_LT(relative_error(r.probs, Tensor::from_vector<double>(probs, {2, 4})), 1e-6);
    const std::vector<double> weights = renormalize ? std::vector<double>{0.5, 0.5, 0.5, 0.5}
                                                    : std::vector<double>{probs[1], probs[2], probs[4], probs[6]};
    EXPECT_LT(relative_error(r.topk_weight, Tensor::from_vector<double>(weights, {2, 2})), 1e-6);
  }
}

TEST(Router, ForwardMatchesDirectSoftmaxAndStableSelection) {
  const int64_t tokens = 9, experts = 8, top_k = 3;
  Rng rng(4);
  const Tensor logits = random_tensor({tokens, experts}, DType::F32, rng, 2.0);
  for (bool renormalize : {false, true}) {
    const Routed r = route(logits, {static_cast<int>(top_k), renormalize});
    Tensor probs = Tensor::empty({tokens, experts}, DType::F64);
    Tensor weights = Tensor::empty({tokens, top_k}, DType::F64);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* l = logits.data<float>() + t * experts;
      double* p = probs.data<double>() + t * experts;
      double z = 0.0;
      for (int64_t e = 0; e < experts; ++e) z += std::exp(static_cast<double>(l[e]));
      for (int64_t e = 0; e < experts; ++e) p[e] = std::exp(static_cast<double>(l[e])) / z;
      // The op's own probabilities decide the order (ties cannot be judged from f64 values).
      const float* op = r.probs.data<float>() + t * experts;
      std::vector<int32_t> order(static_cast<size_t>(experts));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [op](int32_t a, int32_t b) { return op[a] > op[b]; });
      double selected = 0.0;
      for (int64_t k = 0; k < top_k; ++k) {
        EXPECT_EQ(r.topk_index.data<int32_t>()[t * top_k + k], order[static_cast<size_t>(k)]) << "token " << t;
        selected += p[order[static_cast<size_t>(k)]];
      }
      for (int64_t k = 0; k < top_k; ++k) {
        weights.data<double>()[t * top_k + k] = p[order[static_cast<size_t>(k)]] / (renormalize ? selected : 1.0);
      }
    }
    EXPECT_LT(relative_error(r.probs, probs), 1e-6);
    EXPECT_LT(relative_error(r.topk_weight, weights), 1e-6);
  }
}

TEST(Router, TokenResultsDoNotDependOnOtherTokens) {
  Rng rng(8);
  const Tensor logits = random_tensor({12, 6}, DType::F32, rng);
  const Routed all = route(logits, {2, true});
  const Routed part = route(logits.slice(4, 9).clone(), {2, true});
  EXPECT_EQ(all.probs.slice(4, 9).clone().to_vector<float>(), part.probs.to_vector<float>());
  EXPECT_EQ(all.topk_index.slice(4, 9).clone().to_vector<int32_t>(), part.topk_index.to_vector<int32_t>());
  EXPECT_EQ(all.topk_weight.slice(4, 9).clone().to_vector<float>(), part.topk_weight.to_vector<float>());
}

// loss = dot(topk_weight, Rw) (+ dot(probs, Rp) when with_dprobs); dlogits must match central differences.
void expect_backward_matches_finite_differences(bool renormalize, bool with_dprobs) {
  const int64_t tokens = 5, experts = 6;
  const ops::RouterParams params{3, renormalize};
  Rng rng(renormalize * 2 + with_dprobs + 30);
  Tensor logits = separated_logits(tokens, experts, 0.5, rng);
  const Tensor rw = random_tensor({tokens, params.top_k}, DType::F64, rng);
  const Tensor rp = random_tensor({tokens, experts}, DType::F64, rng);
  const Routed r = route(logits, params);
  Tensor dlogits = Tensor::empty({tokens, experts}, DType::F64);
  ops::router_backward(Stream::cpu(), dlogits, rw, with_dprobs ? rp : Tensor(), r.probs, r.topk_index, r.topk_weight,
                       params);
  const std::vector<int32_t> selection = r.topk_index.to_vector<int32_t>();
  const auto loss = [&] {
    const Routed now = route(logits, params);
    EXPECT_EQ(now.topk_index.to_vector<int32_t>(), selection) << "the selection flipped under a finite difference";
    return testing::dot(now.topk_weight, rw) + (with_dprobs ? testing::dot(now.probs, rp) : 0.0);
  };
  testing::expect_gradients_match(loss, {{"logits", logits, dlogits}});
}

TEST(Router, BackwardMatchesFiniteDifferences) { expect_backward_matches_finite_differences(false, false); }

TEST(Router, BackwardWithRenormalizeMatchesFiniteDifferences) {
  expect_backward_matches_finite_differences(true, false);
}

TEST(Router, BackwardWithDprobsMatchesFiniteDifferences) {
  expect_backward_matches_finite_differences(false, true);
  expect_backward_matches_finite_differences(true, true);
}

TEST(Router, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  Rng rng(3);
  const Tensor logits = random_tensor({4, 5}, DType::F32, rng);
  Tensor probs = Tensor::empty({4, 5}, DType::F32), index = Tensor::empty({4, 2}, DType::I32),
         weight = Tensor::empty({4, 2}, DType::F32);
  expect_error(
      [&] {
        ops::router_forward(s, probs, index, weight, logits, {6, false});
      },
      "router_forward: top_k (6) must be in [1, E = 5]");
  expect_error([&] { ops::router_forward(s, probs, index, weight, logits, {0, false}); }, "top_k (0) must be in");
  expect_error(
      [&] {
        ops::router_forward(s, probs, Tensor::empty({4, 2}, DType::I64), weight, logits, {2, false});
      },
      "router_forward: topk_index: expected dtype i32 but found i64");
  expect_error(
      [&] {
        ops::router_forward(s, probs.slice(0, 3), index, weight, logits, {2, false});
      },
      "router_forward: probs: expected shape [4, 5] but found [3, 5]");
  expect_error(
      [&] {
        ops::router_forward(s, probs, index, Tensor::empty({4, 3}, DType::F32), logits, {2, false});
      },
      "router_forward: topk_weight: expected shape [4, 2] but found [4, 3]");
  expect_error(
      [&] {
        ops::router_forward(s, probs, index, weight, logits.to(DType::I32), {2, false});
      },
      "router_forward: expected logits in f32 or f64");

  ops::router_forward(s, probs, index, weight, logits, {2, false});
  Tensor dlogits = Tensor::empty({4, 5}, DType::F32);
  const Tensor dweight = random_tensor({4, 2}, DType::F32, rng);
  expect_error(
      [&] {
        ops::router_backward(s, dlogits, dweight, Tensor::empty({4, 4}, DType::F32), probs, index, weight, {2, false});
      },
      "router_backward: dprobs: expected shape [4, 5] but found [4, 4]");
  expect_error(
      [&] {
        ops::router_backward(s, dlogits, dweight.slice(0, 2), Tensor(), probs, index, weight, {2, false});
      },
      "router_backward: dtopk_weight: expected shape [4, 2] but found [2, 2]");
  Tensor bad_index = index.clone();
  bad_index.data<int32_t>()[5] = 5;
  expect_error(
      [&] {
        ops::router_backward(s, dlogits, dweight, Tensor(), probs, bad_index, weight, {2, false});
      },
      "router_backward: topk_index[2, 1] = 5 is outside [0, E = 5)");
}

}  // namespace
}  // namespace moetrain
