// Tests for ops/router: softmax and top-k selection (hand cases with ties between experts and between groups,
// the routing written out here, greedy and group-limited), the greedy path bit for bit the previous reference, the
// scaling factor, the masked-expert corner, backward against f64 finite differences (renormalisation, scaling,
// group mask, a gradient on the full probabilities), per-token independence, every argument refusal, the
// DeepSeek-V2 gate of transformers itself (tests/data/deepseek_v2_router), and GPT-OSS's top-k over the logits with a
// softmax over the k kept (formula, ties, logits that round to equal probabilities, backward, refusals).
#include "ops/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

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

Tensor route_backward(const Routed& r, const Tensor& dtopk_weight, const Tensor& dprobs,
                      const ops::RouterParams& params) {
  Tensor dlogits = Tensor::empty(r.probs.shape(), r.probs.dtype());
  ops::router_backward(Stream::cpu(), dlogits, dtopk_weight, dprobs, r.probs, r.topk_index, r.topk_weight, params);
  return dlogits;
}

double at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

template <typename T>
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.to_vector<T>() == b.to_vector<T>();
}

// Logits whose experts are at least `gap` apart within each token (a shuffled ladder plus small noise), so a
// finite-difference step never changes the top-k selection nor the kept groups.
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

// The routing written out independently of the op: probabilities are an f64 softmax of the logits; the order is
// judged on the op's own probabilities (ties cannot be judged from f64 values): groups by their largest
// probability (a stable sort keeps equal groups in index order), the scores outside the kept groups 0, experts by a
// stable sort of those scores; weights are the f64 scores, divided by their sum when renormalising, times the
// factor. `changed` counts the tokens whose experts differ from the plain top-k (the group mask mattered).
struct Expected {
  Tensor probs, weights;  // f64
  std::vector<int32_t> index;
  int changed = 0;
};

Expected expected_routing(const Tensor& logits, const Tensor& op_probs, const ops::RouterParams& p) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), k = p.top_k;
  const int64_t size = experts / p.num_groups;
  Expected x{Tensor::empty({tokens, experts}, DType::F64), Tensor::empty({tokens, k}, DType::F64), {}, 0};
  for (int64_t t = 0; t < tokens; ++t) {
    double z = 0.0, max = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) max = std::max(max, at(logits, t * experts + e));
    for (int64_t e = 0; e < experts; ++e) z += std::exp(at(logits, t * experts + e) - max);
    double* prob = x.probs.data<double>() + t * experts;
    for (int64_t e = 0; e < experts; ++e) prob[e] = std::exp(at(logits, t * experts + e) - max) / z;

    std::vector<double> op(static_cast<size_t>(experts));  // the op's probabilities, exactly
    for (int64_t e = 0; e < experts; ++e) op[static_cast<size_t>(e)] = at(op_probs, t * experts + e);
    std::vector<double> group_score(static_cast<size_t>(p.num_groups), 0.0);
    for (int64_t e = 0; e < experts; ++e) {
      double& s = group_score[static_cast<size_t>(e / size)];
      s = std::max(s, op[static_cast<size_t>(e)]);
    }
    std::vector<int> groups(static_cast<size_t>(p.num_groups));
    std::iota(groups.begin(), groups.end(), 0);
    std::stable_sort(groups.begin(), groups.end(),
                     [&](int a, int b) { return group_score[size_t(a)] > group_score[size_t(b)]; });
    std::vector<bool> kept(static_cast<size_t>(p.num_groups), false);
    for (int i = 0; i < p.topk_groups; ++i) kept[static_cast<size_t>(groups[static_cast<size_t>(i)])] = true;
    std::vector<double> masked = op;
    for (int64_t e = 0; e < experts; ++e) {
      if (!kept[static_cast<size_t>(e / size)]) masked[static_cast<size_t>(e)] = 0.0;
    }

    const auto top = [&](const std::vector<double>& score) {
      std::vector<int32_t> order(static_cast<size_t>(experts));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return score[size_t(a)] > score[size_t(b)]; });
      order.resize(static_cast<size_t>(k));
      return order;
    };
    const std::vector<int32_t> chosen = top(masked), greedy = top(op);
    if (std::set<int32_t>(chosen.begin(), chosen.end()) != std::set<int32_t>(greedy.begin(), greedy.end())) {
      ++x.changed;
    }
    double selected = 0.0;
    std::vector<double> w(static_cast<size_t>(k));
    for (int64_t s = 0; s < k; ++s) {
      const int32_t e = chosen[static_cast<size_t>(s)];
      w[static_cast<size_t>(s)] = kept[static_cast<size_t>(e / size)] ? prob[e] : 0.0;
      selected += w[static_cast<size_t>(s)];
    }
    for (int64_t s = 0; s < k; ++s) {
      x.weights.data<double>()[t * k + s] =
          w[static_cast<size_t>(s)] / (p.renormalize ? selected : 1.0) * p.scaling_factor;
      x.index.push_back(chosen[static_cast<size_t>(s)]);
    }
  }
  return x;
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

// Three groups of two experts. Token 0: every group's score is p(3) (bitwise equal), so the lower groups are kept;
// token 1: all equal; token 2: groups 1 and 2 tie above group 0, so one kept group is group 1.
TEST(Router, EqualGroupScoresPickTheLowerGroupIndex) {
  for (const DType dtype : {DType::F32, DType::F64}) {
    const Tensor logits = Tensor::from_vector<double>({1, 3, 3, 0, 2, 3,  //
                                                       0, 0, 0, 0, 0, 0,  //
                                                       0, 1, 2, 0, 2, 1},
                                                      {3, 6})
                              .to(dtype);
    const Routed one = route(logits, {2, false, 3, 1, 1.0});
    EXPECT_EQ(one.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 0, 0, 1, 2, 3}));
    const Routed two = route(logits, {3, false, 3, 2, 1.0});
    EXPECT_EQ(two.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 0, 0, 1, 2, 2, 4, 5}));
    // Token 0, two groups kept: experts 1 and 2 tie at p(3) (lower index first), then expert 0 at p(1).
    const Expected x = expected_routing(logits, two.probs, {3, false, 3, 2, 1.0});
    EXPECT_EQ(two.topk_index.to_vector<int32_t>(), x.index);
    EXPECT_LT(relative_error(two.topk_weight, x.weights), 1e-6);
  }
}

struct GroupCase {
  int64_t experts;
  ops::RouterParams params;
};

const GroupCase kGroupCases[] = {
    {16, {3, false, 4, 2, 16.0}}, {16, {3, true, 4, 2, 16.0}},  {12, {2, false, 3, 1, 2.5}},
    {64, {6, true, 8, 3, 1.0}},   {128, {8, false, 8, 4, 2.5}}, {8, {2, true, 4, 1, 0.5}},
};

TEST(Router, GroupLimitedForwardMatchesTheRoutingWrittenOut) {
  Rng rng(21);
  for (const DType dtype : {DType::F32, DType::F64}) {
    for (const GroupCase& c : kGroupCases) {
      const Tensor logits = random_tensor({40, c.experts}, dtype, rng, 2.0);
      const Routed r = route(logits, c.params);
      const Expected x = expected_routing(logits, r.probs, c.params);
      const std::string what = "E=" + std::to_string(c.experts) + " K=" + std::to_string(c.params.top_k) + " groups " +
                               std::to_string(c.params.topk_groups) + "/" + std::to_string(c.params.num_groups) + " " +
                               std::string(dtype_name(dtype));
      EXPECT_GT(x.changed, 0) << what << ": the group mask changed no selection";
      EXPECT_EQ(r.topk_index.to_vector<int32_t>(), x.index) << what;
      const double bound = dtype == DType::F32 ? 1e-6 : 1e-12;
      EXPECT_LT(relative_error(r.probs, x.probs), bound) << what;
      EXPECT_LT(relative_error(r.topk_weight, x.weights), bound) << what;
    }
  }
}

TEST(Router, ForwardMatchesDirectSoftmaxAndStableSelection) {
  const int64_t tokens = 9, experts = 8, top_k = 3;
  Rng rng(4);
  const Tensor logits = random_tensor({tokens, experts}, DType::F32, rng, 2.0);
  for (bool renormalize : {false, true}) {
    const ops::RouterParams params{static_cast<int>(top_k), renormalize};
    const Routed r = route(logits, params);
    const Expected x = expected_routing(logits, r.probs, params);
    EXPECT_EQ(x.changed, 0);
    EXPECT_EQ(r.topk_index.to_vector<int32_t>(), x.index);
    EXPECT_LT(relative_error(r.probs, x.probs), 1e-6);
    EXPECT_LT(relative_error(r.topk_weight, x.weights), 1e-6);
  }
}

// The router reference before group-limited top-k and the scaling factor, kept verbatim (one thread): the greedy
// path must still produce these bytes.
template <typename T>
void previous_forward(const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight, const Tensor& logits,
                      int64_t top_k, bool renormalize) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits.data<T>() + t * experts;
    T* p = probs.data<T>() + t * experts;
    const T max = *std::max_element(l, l + experts);
    T sum = T(0);
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(l[e] - max);
      sum += p[e];
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    int32_t* index = topk_index.data<int32_t>() + t * top_k;
    T* weight = topk_weight.data<T>() + t * top_k;
    T selected = T(0);
    for (int64_t s = 0; s < top_k; ++s) {
      index[s] = order[static_cast<size_t>(s)];
      weight[s] = p[index[s]];
      selected += weight[s];
    }
    if (renormalize) {
      for (int64_t s = 0; s < top_k; ++s) weight[s] /= selected;
    }
  }
}

template <typename T>
void previous_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                       const Tensor& topk_index, const Tensor& topk_weight, int64_t top_k, bool renormalize) {
  const int64_t tokens = probs.size(0), experts = probs.size(1);
  std::vector<T> dp(static_cast<size_t>(experts)), dw_raw(static_cast<size_t>(top_k));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* p = probs.data<T>() + t * experts;
    const int32_t* index = topk_index.data<int32_t>() + t * top_k;
    const T* dw = dtopk_weight.data<T>() + t * top_k;
    if (renormalize) {
      const T* w_norm = topk_weight.data<T>() + t * top_k;
      T selected = T(0);
      T inner = T(0);
      for (int64_t s = 0; s < top_k; ++s) {
        selected += p[index[s]];
        inner += dw[s] * w_norm[s];
      }
      for (int64_t s = 0; s < top_k; ++s) dw_raw[static_cast<size_t>(s)] = (dw[s] - inner) / selected;
    } else {
      std::copy(dw, dw + top_k, dw_raw.begin());
    }
    for (int64_t e = 0; e < experts; ++e) {
      dp[static_cast<size_t>(e)] = dprobs.defined() ? dprobs.data<T>()[t * experts + e] : T(0);
    }
    for (int64_t s = 0; s < top_k; ++s) dp[static_cast<size_t>(index[s])] += dw_raw[static_cast<size_t>(s)];
    T inner = T(0);
    for (int64_t e = 0; e < experts; ++e) inner += p[e] * dp[static_cast<size_t>(e)];
    T* dl = dlogits.data<T>() + t * experts;
    for (int64_t e = 0; e < experts; ++e) dl[e] = p[e] * (dp[static_cast<size_t>(e)] - inner);
  }
}

template <typename T>
void expect_greedy_is_the_previous_reference(DType dtype) {
  const int64_t tokens = 33, experts = 24, top_k = 4;
  Rng rng(5);
  for (const bool renormalize : {false, true}) {
    const Tensor logits = random_tensor({tokens, experts}, dtype, rng, 2.0);
    const Tensor dw = random_tensor({tokens, top_k}, dtype, rng);
    const Tensor dprobs = random_tensor({tokens, experts}, dtype, rng);
    Routed old{Tensor::empty({tokens, experts}, dtype), Tensor::empty({tokens, top_k}, DType::I32),
               Tensor::empty({tokens, top_k}, dtype)};
    previous_forward<T>(old.probs, old.topk_index, old.topk_weight, logits, top_k, renormalize);
    // Plain greedy, and every group kept (the mask is the identity) in groups of 6 and of 1.
    for (const ops::RouterParams& params : {ops::RouterParams{4, renormalize}, ops::RouterParams{4, renormalize, 4, 4},
                                            ops::RouterParams{4, renormalize, 24, 24, 1.0}}) {
      const std::string what = std::string(dtype_name(dtype)) + (renormalize ? " renormalized" : "") + " groups " +
                               std::to_string(params.num_groups);
      const Routed now = route(logits, params);
      EXPECT_TRUE(same_bits<T>(now.probs, old.probs)) << what;
      EXPECT_EQ(now.topk_index.to_vector<int32_t>(), old.topk_index.to_vector<int32_t>()) << what;
      EXPECT_TRUE(same_bits<T>(now.topk_weight, old.topk_weight)) << what;
      for (const Tensor& d : {Tensor(), dprobs}) {
        Tensor expected = Tensor::empty({tokens, experts}, dtype);
        previous_backward<T>(expected, dw, d, old.probs, old.topk_index, old.topk_weight, top_k, renormalize);
        EXPECT_TRUE(same_bits<T>(route_backward(now, dw, d, params), expected))
            << what << (d.defined() ? " with dprobs" : "");
      }
    }
  }
}

TEST(Router, GreedyPathIsBitwiseThePreviousReference) {
  expect_greedy_is_the_previous_reference<float>(DType::F32);
  expect_greedy_is_the_previous_reference<double>(DType::F64);
}

// Renormalisation comes first, then the factor: a power of two scales the weights exactly.
TEST(Router, ScalingFactorMultipliesTheSelectedWeightsAfterRenormalisation) {
  Rng rng(6);
  const Tensor logits = random_tensor({20, 16}, DType::F32, rng, 2.0);
  for (const bool renormalize : {false, true}) {
    for (const int groups : {1, 4}) {
      const Routed plain = route(logits, {3, renormalize, groups, groups == 1 ? 1 : 2, 1.0});
      const Routed scaled = route(logits, {3, renormalize, groups, groups == 1 ? 1 : 2, 16.0});
      EXPECT_EQ(scaled.topk_index.to_vector<int32_t>(), plain.topk_index.to_vector<int32_t>());
      EXPECT_TRUE(same_bits<float>(scaled.probs, plain.probs));
      std::vector<float> expected = plain.topk_weight.to_vector<float>();
      for (float& w : expected) w *= 16.0f;
      EXPECT_EQ(scaled.topk_weight.to_vector<float>(), expected);
      if (renormalize) {
        for (int64_t t = 0; t < 20; ++t) {
          double sum = 0.0;
          for (int64_t s = 0; s < 3; ++s) sum += scaled.topk_weight.data<float>()[t * 3 + s];
          EXPECT_NEAR(sum, 16.0, 16.0 * 1e-6) << "token " << t;
        }
      }
    }
  }
}

// Only one group is kept and one of its two experts underflows to probability 0 in f32, so the second selection
// ties at 0 between it and the masked experts of group 0: the lower index wins, a masked expert, whose weight is
// the masked score 0 and which carries no gradient (its probability exp(-70) is not 0, so a gradient would show).
TEST(Router, MaskedExpertIsSelectedOnlyAtAZeroTieWithZeroWeightAndNoGradient) {
  const Tensor logits = Tensor::from_vector<float>({50, 50, 120, 0}, {1, 4});
  const ops::RouterParams params{2, false, 2, 1, 2.0};
  const Routed r = route(logits, params);
  const std::vector<float> p = r.probs.to_vector<float>();
  ASSERT_GT(p[0], 0.0f);
  ASSERT_EQ(p[3], 0.0f);
  EXPECT_EQ(r.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(r.topk_weight.to_vector<float>(), (std::vector<float>{2.0f * p[2], 0.0f}));

  const Tensor dw = Tensor::from_vector<float>({0.75f, -1.5f}, {1, 2});
  const std::vector<float> dl = route_backward(r, dw, Tensor(), params).to_vector<float>();
  // dp = (0, 0, c dw_0, 0): dlogits_e = p_e (dp_e - p_2 c dw_0).
  const double inner = double(p[2]) * 2.0 * 0.75;
  const std::vector<double> expected{-double(p[0]) * inner, -double(p[1]) * inner, double(p[2]) * (1.5 - inner), 0.0};
  for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(dl[e], expected[e], 1e-6 * std::abs(expected[e]) + 1e-40) << e;
}

TEST(Router, TokenResultsDoNotDependOnOtherTokens) {
  Rng rng(8);
  const Tensor logits = random_tensor({12, 6}, DType::F32, rng);
  for (const ops::RouterParams& params : {ops::RouterParams{2, true}, ops::RouterParams{2, true, 3, 2, 2.5},
                                          ops::RouterParams{2, false, 1, 1, 1.0, true}}) {
    const Routed all = route(logits, params);
    const Routed part = route(logits.slice(4, 9).clone(), params);
    EXPECT_EQ(all.probs.slice(4, 9).clone().to_vector<float>(), part.probs.to_vector<float>());
    EXPECT_EQ(all.topk_index.slice(4, 9).clone().to_vector<int32_t>(), part.topk_index.to_vector<int32_t>());
    EXPECT_EQ(all.topk_weight.slice(4, 9).clone().to_vector<float>(), part.topk_weight.to_vector<float>());
  }
}

// loss = dot(topk_weight, Rw) (+ dot(probs, Rp) when with_dprobs); dlogits must match central differences.
void expect_backward_matches_finite_differences(const ops::RouterParams& params, int64_t experts, bool with_dprobs) {
  const int64_t tokens = 8;
  Rng rng(params.renormalize * 2 + with_dprobs + (params.num_groups - 1) * 4 + 30);
  Tensor logits = separated_logits(tokens, experts, 0.5, rng);
  const Tensor rw = random_tensor({tokens, params.top_k}, DType::F64, rng);
  const Tensor rp = random_tensor({tokens, experts}, DType::F64, rng);
  const Routed r = route(logits, params);
  if (params.topk_groups < params.num_groups) {
    EXPECT_GT(expected_routing(logits, r.probs, params).changed, 0) << "the group mask changed no selection";
  }
  const Tensor dlogits = route_backward(r, rw, with_dprobs ? rp : Tensor(), params);
  const std::vector<int32_t> selection = r.topk_index.to_vector<int32_t>();
  const auto loss = [&] {
    const Routed now = route(logits, params);
    EXPECT_EQ(now.topk_index.to_vector<int32_t>(), selection) << "the selection flipped under a finite difference";
    return testing::dot(now.topk_weight, rw) + (with_dprobs ? testing::dot(now.probs, rp) : 0.0);
  };
  testing::expect_gradients_match(loss, {{"logits", logits, dlogits}});
}

TEST(Router, BackwardMatchesFiniteDifferences) { expect_backward_matches_finite_differences({3, false}, 6, false); }

TEST(Router, BackwardWithRenormalizeMatchesFiniteDifferences) {
  expect_backward_matches_finite_differences({3, true}, 6, false);
}

TEST(Router, BackwardWithDprobsMatchesFiniteDifferences) {
  expect_backward_matches_finite_differences({3, false}, 6, true);
  expect_backward_matches_finite_differences({3, true}, 6, true);
}

TEST(Router, BackwardWithScalingFactorMatchesFiniteDifferences) {
  for (const bool renormalize : {false, true}) {
    for (const bool with_dprobs : {false, true}) {
      expect_backward_matches_finite_differences({3, renormalize, 1, 1, 2.5}, 6, with_dprobs);
    }
  }
}

TEST(Router, BackwardWithGroupMaskMatchesFiniteDifferences) {
  for (const bool renormalize : {false, true}) {
    for (const bool with_dprobs : {false, true}) {
      expect_backward_matches_finite_differences({3, renormalize, 4, 2, 2.5}, 12, with_dprobs);
      expect_backward_matches_finite_differences({2, renormalize, 3, 1, 1.0}, 12, with_dprobs);
    }
  }
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

TEST(Router, RejectsBadGroupsAndScalingFactorNamingTheValue) {
  Stream& s = Stream::cpu();
  Rng rng(9);
  const Tensor logits = random_tensor({4, 12}, DType::F32, rng);
  const auto forward = [&](const ops::RouterParams& params, const Tensor& l) {
    Tensor probs = Tensor::empty({4, 12}, l.dtype()), index = Tensor::empty({4, params.top_k}, DType::I32),
           weight = Tensor::empty({4, params.top_k}, l.dtype());
    ops::router_forward(s, probs, index, weight, l, params);
  };
  const auto refused = [&](const ops::RouterParams& params, const std::string& needle) {
    expect_error([&] { forward(params, logits); }, needle);
  };
  refused({2, false, 0, 1, 1.0}, "router_forward: num_groups (0) must be at least 1");
  refused({2, false, -3, 1, 1.0}, "router_forward: num_groups (-3) must be at least 1");
  refused({2, false, 5, 1, 1.0}, "router_forward: E = 12 is not divisible by num_groups (5)");
  refused({2, false, 4, 0, 1.0}, "router_forward: topk_groups (0) must be in [1, num_groups = 4]");
  refused({2, false, 4, 5, 1.0}, "router_forward: topk_groups (5) must be in [1, num_groups = 4]");
  refused({2, false, 1, 2, 1.0}, "router_forward: topk_groups (2) must be in [1, num_groups = 1]");
  refused({4, false, 4, 1, 1.0},
          "router_forward: top_k (4) exceeds the experts of the kept groups: topk_groups (1) x E / num_groups (3) = 3");
  refused({7, false, 4, 2, 1.0},
          "router_forward: top_k (7) exceeds the experts of the kept groups: topk_groups (2) x E / num_groups (3) = 6");
  refused({2, false, 1, 1, 0.0}, "router_forward: scaling_factor (0) must be finite and > 0");
  refused({2, false, 1, 1, -1.5}, "router_forward: scaling_factor (-1.5) must be finite and > 0");
  refused({2, false, 1, 1, std::numeric_limits<double>::quiet_NaN()},
          "router_forward: scaling_factor (nan) must be finite and > 0");
  refused({2, false, 1, 1, std::numeric_limits<double>::infinity()},
          "router_forward: scaling_factor (inf) must be finite and > 0");
  // Finite and positive in f64 but not once rounded to f32: refused for f32 logits only.
  refused({2, false, 1, 1, 1e300}, "router_forward: scaling_factor (1e+300) is not a finite positive f32 (inf)");
  refused({2, false, 1, 1, 1e-50}, "router_forward: scaling_factor (1e-50) is not a finite positive f32 (0)");
  forward({2, false, 1, 1, 1e300}, logits.to(DType::F64));
  // The limits themselves are accepted: top_k filling the kept groups, every group kept, one expert per group.
  forward({6, false, 4, 2, 1.0}, logits);
  forward({2, false, 4, 4, 1.0}, logits);
  forward({3, false, 12, 3, 1.0}, logits);

  // The backward checks the same parameters.
  const Routed r = route(logits, {2, false});
  const Tensor dweight = random_tensor({4, 2}, DType::F32, rng);
  expect_error(
      [&] {
        route_backward(r, dweight, Tensor(), {2, false, 5, 1, 1.0});
      },
      "router_backward: E = 12 is not divisible by num_groups (5)");
  expect_error(
      [&] {
        route_backward(r, dweight, Tensor(), {2, false, 1, 1, -2.0});
      },
      "router_backward: scaling_factor (-2) must be finite and > 0");
  // And the check on its own, as blocks run it when they are built.
  expect_error(
      [&] {
        ops::check_router_params({2, false, 4, 3, 1.0}, 10, "router block");
      },
      "router block: E = 10 is not divisible by num_groups (4)");
}

// transformers 5.17's DeepSeek-V2 gate (group_limited_greedy, E = 16 in 4 groups, 2 kept, top-3, factor 16) on 64
// seeded tokens (tests/data/deepseek_v2_router/make_gate_fixture.py). Its topk is unsorted, so each token's experts
// are compared as a set, and each weight with the weight of the same expert. Its boundaries are at least 0.5%
// apart (kth vs (k+1)th score, and groups), far above the f32 softmax's few-ulp differences.
TEST(Router, MatchesTransformersDeepseekV2Gate) {
  const io::SafetensorsFile file =
      io::SafetensorsFile::open(testing::test_data_path("deepseek_v2_router/gate.safetensors"));
  const Tensor logits = file.tensor("logits").clone();
  const Tensor hf_index = file.tensor("topk_idx"), hf_weight = file.tensor("topk_weight");
  const int64_t tokens = logits.size(0), k = hf_index.size(1);
  ASSERT_EQ(logits.size(1), 16);
  ASSERT_EQ(k, 3);
  ASSERT_NE(file.metadata().at("tokens_changed_by_the_group_mask"), "0");
  const Routed r = route(logits, {3, false, 4, 2, 16.0});
  const std::vector<int32_t> ours = r.topk_index.to_vector<int32_t>();
  const std::vector<float> our_weight = r.topk_weight.to_vector<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = hf_index.data<int64_t>()[t * k + s];
      const float w = hf_weight.data<float>()[t * k + s];
      const auto begin = ours.begin() + t * k, end = begin + k;
      const auto found = std::find(begin, end, static_cast<int32_t>(e));
      ASSERT_NE(found, end) << "token " << t << ": transformers selects expert " << e;
      const float mine = our_weight[static_cast<size_t>(found - ours.begin())];
      EXPECT_NEAR(mine, w, 1e-6 * std::abs(w)) << "token " << t << " expert " << e;
    }
  }
}

// GPT-OSS's router written out: probs the f64 softmax of all logits, the selection a stable sort of the logits
// (equal logits keep index order), the weights the f64 softmax of the k selected logits.
Expected expected_topk_then_softmax(const Tensor& logits, int64_t k) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Expected x{Tensor::empty({tokens, experts}, DType::F64), Tensor::empty({tokens, k}, DType::F64), {}, 0};
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> l(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) l[static_cast<size_t>(e)] = at(logits, t * experts + e);
    const double max = *std::max_element(l.begin(), l.end());
    double z = 0.0;
    for (const double v : l) z += std::exp(v - max);
    for (int64_t e = 0; e < experts; ++e) x.probs.data<double>()[t * experts + e] = std::exp(l[size_t(e)] - max) / z;
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
    double zk = 0.0;
    for (int64_t s = 0; s < k; ++s) zk += std::exp(l[size_t(order[size_t(s)])] - max);
    for (int64_t s = 0; s < k; ++s) {
      x.index.push_back(order[static_cast<size_t>(s)]);
      x.weights.data<double>()[t * k + s] = std::exp(l[size_t(order[size_t(s)])] - max) / zk;
    }
  }
  return x;
}

ops::RouterParams topk_then_softmax(int top_k) {
  ops::RouterParams p{top_k};
  p.topk_before_softmax = true;
  return p;
}

TEST(Router, TopkBeforeSoftmaxMatchesTheTransformersFormula) {
  Rng rng(50);
  for (const DType dtype : {DType::F32, DType::F64}) {
    for (const int64_t experts : {8, 32, 128}) {
      for (const int k : {1, 4}) {
        const std::string what =
            std::string(dtype_name(dtype)) + " E=" + std::to_string(experts) + " K=" + std::to_string(k);
        const Tensor logits = random_tensor({40, experts}, dtype, rng, 2.0);
        const Routed r = route(logits, topk_then_softmax(k));
        const Expected x = expected_topk_then_softmax(logits, k);
        EXPECT_EQ(r.topk_index.to_vector<int32_t>(), x.index) << what;
        // f32: exp and a sum over at most 128 terms, a few ulp; f64 likewise at its precision.
        const double bound = dtype == DType::F32 ? 1e-6 : 1e-12;
        EXPECT_LT(relative_error(r.probs, x.probs), bound) << what;
        EXPECT_LT(relative_error(r.topk_weight, x.weights), bound) << what;
        // The k-softmax equals the renormalised top-k probabilities in exact arithmetic.
        const Routed renormalized = route(logits, {k, true});
        EXPECT_EQ(renormalized.topk_index.to_vector<int32_t>(), x.index) << what;
        EXPECT_LT(relative_error(r.topk_weight, renormalized.topk_weight), bound) << what;
      }
    }
  }
}

TEST(Router, TopkBeforeSoftmaxBreaksTiesByLowerExpertIndex) {
  for (const DType dtype : {DType::F32, DType::F64}) {
    const Tensor logits = Tensor::from_vector<double>({1, 3, 3, 0,  //
                                                       2, 0, 2, 2,  //
                                                       0, 0, 0, 0},
                                                      {3, 4})
                              .to(dtype);
    const Routed r = route(logits, topk_then_softmax(3));
    EXPECT_EQ(r.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 0, 0, 2, 3, 0, 1, 2}));
    const double w = 1.0 / (2.0 + std::exp(-2.0));
    const Tensor want = Tensor::from_vector<double>(
        {w, w, w * std::exp(-2.0), 1.0 / 3, 1.0 / 3, 1.0 / 3, 1.0 / 3, 1.0 / 3, 1.0 / 3}, {3, 3});
    // A few roundings per weight (exp, a sum of three, a division): 1e-6 in f32, 1e-15 in f64.
    EXPECT_LT(relative_error(r.topk_weight, want), dtype == DType::F32 ? 1e-6 : 1e-15);
  }
}

// 1000 and the next f32 above it both underflow to probability 0 beside 2000: ranking the probabilities would tie
// and pick expert 0, ranking the logits (transformers' topk on router_logits) picks expert 1.
TEST(Router, TopkBeforeSoftmaxRanksTheLogitsNotTheRoundedProbabilities) {
  const float above = std::nextafter(1000.0f, 2000.0f);
  const Tensor logits = Tensor::from_vector<float>({1000.0f, above, 2000.0f}, {1, 3});
  const Routed r = route(logits, topk_then_softmax(2));
  ASSERT_EQ(r.probs.to_vector<float>()[0], 0.0f);
  ASSERT_EQ(r.probs.to_vector<float>()[1], 0.0f);
  EXPECT_EQ(r.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(r.topk_weight.to_vector<float>(), (std::vector<float>{1.0f, 0.0f}));
  EXPECT_EQ(route(logits, {2, true}).topk_index.to_vector<int32_t>(), (std::vector<int32_t>{2, 0}));
}

TEST(Router, TopkBeforeSoftmaxBackwardMatchesFiniteDifferences) {
  for (const bool with_dprobs : {false, true}) {
    expect_backward_matches_finite_differences(topk_then_softmax(3), 6, with_dprobs);
    expect_backward_matches_finite_differences(topk_then_softmax(1), 5, with_dprobs);
    expect_backward_matches_finite_differences(topk_then_softmax(8), 8, with_dprobs);  // every expert kept
  }
}

// Without dprobs only the selected logits receive a gradient; the k-softmax gradient sums to 0 over them.
TEST(Router, TopkBeforeSoftmaxGradientReachesOnlyTheSelectedLogits) {
  Rng rng(51);
  const Tensor logits = random_tensor({7, 16}, DType::F64, rng, 2.0);
  const ops::RouterParams params = topk_then_softmax(4);
  const Routed r = route(logits, params);
  const Tensor dl = route_backward(r, random_tensor({7, 4}, DType::F64, rng), Tensor(), params);
  const std::vector<int32_t> index = r.topk_index.to_vector<int32_t>();
  for (int64_t t = 0; t < 7; ++t) {
    double sum = 0.0;
    for (int64_t e = 0; e < 16; ++e) {
      const double v = dl.data<double>()[t * 16 + e];
      const bool selected = std::find(index.begin() + t * 4, index.begin() + t * 4 + 4, e) != index.begin() + t * 4 + 4;
      if (!selected) {
        EXPECT_EQ(v, 0.0) << "token " << t << " expert " << e;
      }
      sum += v;
    }
    // Zero in exact arithmetic; four terms of size up to |dw| (< 10) each rounded once in f64.
    EXPECT_NEAR(sum, 0.0, 1e-13) << "token " << t;
  }
}

TEST(Router, TopkBeforeSoftmaxRefusesRenormalizeScalingAndGroups) {
  ops::RouterParams p = topk_then_softmax(2);
  p.renormalize = true;
  expect_error([&] { ops::check_router_params(p, 8, "router block"); },
               "router block: topk_before_softmax takes no renormalize");
  p = topk_then_softmax(2);
  p.scaling_factor = 2.5;
  expect_error([&] { ops::check_router_params(p, 8, "router block"); },
               "router block: topk_before_softmax takes no scaling_factor but found 2.5 (expected 1)");
  p = topk_then_softmax(2);
  p.num_groups = 4;
  p.topk_groups = 4;  // every group kept: still refused, groups have no meaning here
  expect_error([&] { ops::check_router_params(p, 8, "router block"); },
               "router block: topk_before_softmax takes no group-limited selection but found num_groups = 4 "
               "(expected 1)");
  ops::check_router_params(topk_then_softmax(2), 8, "router block");

  // The ops run the same checks, forward and backward.
  Rng rng(52);
  const Tensor logits = random_tensor({3, 8}, DType::F32, rng);
  Tensor probs = Tensor::empty({3, 8}, DType::F32), index = Tensor::empty({3, 2}, DType::I32),
         weight = Tensor::empty({3, 2}, DType::F32);
  ops::RouterParams bad = topk_then_softmax(2);
  bad.renormalize = true;
  expect_error([&] { ops::router_forward(Stream::cpu(), probs, index, weight, logits, bad); },
               "router_forward: topk_before_softmax takes no renormalize");
  const Routed r = route(logits, topk_then_softmax(2));
  bad = topk_then_softmax(2);
  bad.scaling_factor = 16.0;
  expect_error(
      [&] {
        route_backward(r, random_tensor({3, 2}, DType::F32, rng), Tensor(), bad);
      },
      "router_backward: topk_before_softmax takes no scaling_factor but found 16 (expected 1)");
}

// router_forward_given: the selection is an input (check-golden's routing pinned to the reference's choices).
Routed route_given(const Tensor& logits, const Tensor& topk_index, const ops::RouterParams& params) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Routed r{Tensor::empty({tokens, experts}, logits.dtype()), topk_index.clone(),
           Tensor::empty({tokens, params.top_k}, logits.dtype())};
  ops::router_forward_given(Stream::cpu(), r.probs, r.topk_index, r.topk_weight, logits, params);
  return r;
}

TEST(Router, GivenOwnSelectionIsBitwiseTheSelectingForward) {
  Rng rng(70);
  const ops::RouterParams cases[] = {
      {2}, {6, true}, {6, false, 8, 3, 16.0}, {4, true, 4, 2, 2.5}, topk_then_softmax(4)};
  for (const DType dtype : {DType::F32, DType::F64}) {
    for (const ops::RouterParams& params : cases) {
      const Tensor logits = random_tensor({50, 64}, dtype, rng, 2.0);
      const Routed own = route(logits, params);
      const Routed given = route_given(logits, own.topk_index, params);
      EXPECT_EQ(given.topk_index.to_vector<int32_t>(), own.topk_index.to_vector<int32_t>());
      if (dtype == DType::F32) {
        EXPECT_TRUE(same_bits<float>(given.probs, own.probs));
        EXPECT_TRUE(same_bits<float>(given.topk_weight, own.topk_weight));
      } else {
        EXPECT_TRUE(same_bits<double>(given.probs, own.probs));
        EXPECT_TRUE(same_bits<double>(given.topk_weight, own.topk_weight));
      }
    }
  }
}

TEST(Router, GivenOtherSelectionWeighsTheGivenExperts) {
  // Token 0 takes experts {1, 3} (not its top-2 {0, 2}), in that slot order.
  const Tensor logits = Tensor::from_vector<double>({2.0, 0.5, 1.0, -1.0}, {1, 4});
  const Tensor given = Tensor::from_vector<int32_t>({1, 3}, {1, 2});
  double z = 0.0;
  for (const double l : {2.0, 0.5, 1.0, -1.0}) z += std::exp(l);
  const double p1 = std::exp(0.5) / z, p3 = std::exp(-1.0) / z;
  // Softmax, then the given experts' probabilities, renormalised and scaled.
  const Routed greedy = route_given(logits, given, {2, true, 1, 1, 3.0});
  EXPECT_EQ(greedy.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(at(greedy.topk_weight, 0), 3.0 * p1 / (p1 + p3), 1e-14);
  EXPECT_NEAR(at(greedy.topk_weight, 1), 3.0 * p3 / (p1 + p3), 1e-14);
  // GPT-OSS: the softmax over the given logits, whatever their slot order.
  const Routed gpt = route_given(logits, Tensor::from_vector<int32_t>({3, 1}, {1, 2}), topk_then_softmax(2));
  const double e1 = std::exp(0.5), e3 = std::exp(-1.0);
  EXPECT_NEAR(at(gpt.topk_weight, 0), e3 / (e1 + e3), 1e-14);
  EXPECT_NEAR(at(gpt.topk_weight, 1), e1 / (e1 + e3), 1e-14);
  // Group-limited: an expert outside the kept groups weighs 0 (its masked score), as in the backward's mask.
  const Tensor grouped = Tensor::from_vector<double>({2.0, 1.5, -1.0, -2.0}, {1, 4});
  const Routed masked = route_given(grouped, Tensor::from_vector<int32_t>({0, 2}, {1, 2}), {2, false, 2, 1, 1.0});
  EXPECT_GT(at(masked.topk_weight, 0), 0.0);
  EXPECT_EQ(at(masked.topk_weight, 1), 0.0);
}

TEST(Router, GivenSelectionRefusesOutOfRangeAndRepeatedExperts) {
  const Tensor logits = Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f}, {2, 4});
  expect_error(
      [&] {
        route_given(logits, Tensor::from_vector<int32_t>({0, 1, 2, 4}, {2, 2}), {2});
      },
      "topk_index[1, 1] = 4 is outside [0, E = 4)");
  expect_error(
      [&] {
        route_given(logits, Tensor::from_vector<int32_t>({0, -1, 2, 3}, {2, 2}), {2});
      },
      "topk_index[0, 1] = -1 is outside");
  expect_error(
      [&] {
        route_given(logits, Tensor::from_vector<int32_t>({0, 1, 3, 3}, {2, 2}), {2});
      },
      "topk_index[1] names expert 3 twice (slots 0 and 1)");
  expect_error([&] { route_given(logits, Tensor::from_vector<int32_t>({0, 1}, {1, 2}), {2}); }, "topk_index");
}

}  // namespace
}  // namespace moetrain
