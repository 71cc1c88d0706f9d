// Tests for the router block (model/blocks/router.*): its logits, probabilities, top-k, weights and routing plan
// are bitwise ops::router_forward on linear_forward's logits (greedy, renormalised, scaled, group-limited) and agree
// with a softmax, a group mask and a selection written out here; its input and weight gradients are bitwise
// ops::router_backward and the linear backward (with and without the load-balance and z-loss gradients); GPT-OSS's
// biased top-k-then-softmax router likewise; sigmoid scores, and group or scaling options the op would refuse, are
// refused by name when it is built.
#include "model/blocks/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "ops/bias.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/permute.h"
#include "ops/router.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using block_testing::contains;
using block_testing::error_message;
using block_testing::fill_random;
using block_testing::values;
using block_testing::with_whole_pieces;
using testing::random_tensor;

constexpr int64_t kHidden = 12, kExperts = 6, kTopK = 2, kTokens = 9;

struct RouterCase {
  const char* name;
  bool renormalize;
  int64_t num_groups, topk_groups;
  double scaling_factor;
};

// Six experts; the group-limited cases keep one of three groups of two, so top-2 is the best group's pair (with two
// kept groups top-2 never differs from the plain top-2: the ops tests hold that case, with larger K).
const RouterCase kCases[] = {
    {"Plain", false, 1, 1, 1.0},
    {"Renormalized", true, 1, 1, 1.0},
    {"Scaled", false, 1, 1, 2.5},
    {"GroupLimited", false, 3, 1, 1.0},
    {"GroupLimitedRenormalizedScaled", true, 3, 1, 16.0},
};

void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

RouterOptions router_options(const RouterCase& c) {
  RouterOptions o;
  o.hidden_size = kHidden;
  o.num_experts = kExperts;
  o.top_k = kTopK;
  o.renormalize = c.renormalize;
  o.num_groups = c.num_groups;
  o.topk_groups = c.topk_groups;
  o.scaling_factor = c.scaling_factor;
  return o;
}

ops::RouterParams op_params(const RouterOptions& o) {
  return {static_cast<int>(o.top_k), o.renormalize, static_cast<int>(o.num_groups), static_cast<int>(o.topk_groups),
          o.scaling_factor};
}

struct OpsRouting {
  Tensor logits, probs, topk_index, topk_weight;
};

// The routing of given logits by the op.
OpsRouting ops_routing_of(const Tensor& logits, const RouterOptions& o) {
  OpsRouting r{logits, Tensor::empty({kTokens, kExperts}, DType::F32), Tensor::empty({kTokens, kTopK}, DType::I32),
               Tensor::empty({kTokens, kTopK}, DType::F32)};
  ops::router_forward(Stream::cpu(), r.probs, r.topk_index, r.topk_weight, r.logits, op_params(o));
  return r;
}

OpsRouting ops_routing(const Tensor& x, const Tensor& w, const RouterOptions& o) {
  Stream& s = Stream::cpu();
  OpsRouting r{Tensor::empty({kTokens, kExperts}, DType::F32), Tensor::empty({kTokens, kExperts}, DType::F32),
               Tensor::empty({kTokens, kTopK}, DType::I32), Tensor::empty({kTokens, kTopK}, DType::F32)};
  ops::linear_forward(s, r.logits, x, w);
  ops::router_forward(s, r.probs, r.topk_index, r.topk_weight, r.logits, op_params(o));
  return r;
}

class RouterBlock : public ::testing::TestWithParam<RouterCase> {
 protected:
  void SetUp() override {
    options = router_options(GetParam());
    store = std::make_unique<ParameterStore>(with_whole_pieces(Router::param_specs(options, "layers.1.", 1)));
    fill_random(*store, 41, 0.5);
    Rng rng(42);
    x = random_tensor({kTokens, kHidden}, DType::F32, rng);
  }

  RouterOptions options;
  std::unique_ptr<ParameterStore> store;
  Tensor x;
};

TEST_P(RouterBlock, ForwardIsBitwiseRouterForwardOnLinearLogits) {
  const Router router(options, *store, "layers.1.");
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x, Tensor());
  ASSERT_TRUE(m.defined());
  const OpsRouting ref = ops_routing(x, store->param("layers.1.router"), options);
  EXPECT_EQ(values(m.logits), values(ref.logits));
  EXPECT_EQ(values(m.probs), values(ref.probs));
  EXPECT_EQ(m.topk_index.to_vector<int32_t>(), ref.topk_index.to_vector<int32_t>());
  EXPECT_EQ(values(m.topk_weight), values(ref.topk_weight));
  const ops::RoutingPlan plan = ops::make_routing_plan(Stream::cpu(), ref.topk_index, kExperts);
  EXPECT_EQ(m.plan.num_tokens, kTokens);
  EXPECT_EQ(m.plan.top_k, kTopK);
  EXPECT_EQ(m.plan.num_experts, kExperts);
  EXPECT_EQ(m.plan.expert_offsets.to_vector<int32_t>(), plan.expert_offsets.to_vector<int32_t>());
  EXPECT_EQ(m.plan.row_choice.to_vector<int32_t>(), plan.row_choice.to_vector<int32_t>());
  EXPECT_EQ(m.plan.choice_row.to_vector<int32_t>(), plan.choice_row.to_vector<int32_t>());
}

// Pinned routing (check-golden's diagnostic): the experts are those the router's own rule selects on the pinned
// logits, weighed from the block's own logits; pinned to its own logits, the block is bitwise its unpinned self.
TEST_P(RouterBlock, PinnedLogitsSelectTheExpertsAndTheOwnLogitsWeighThem) {
  const Router router(options, *store, "layers.1.");
  RouterRecord free_record, self_record, other_record;
  const RoutingMetadata free = router.forward(free_record, x, Tensor());
  const RoutingMetadata self = router.forward(self_record, x, free.logits);
  EXPECT_EQ(self.topk_index.to_vector<int32_t>(), free.topk_index.to_vector<int32_t>());
  EXPECT_EQ(values(self.topk_weight), values(free.topk_weight));
  EXPECT_EQ(values(self.probs), values(free.probs));
  Rng rng(43);
  const Tensor other = random_tensor({kTokens, kExperts}, DType::F32, rng, 3.0);
  const RoutingMetadata pinned = router.forward(other_record, x, other);
  const OpsRouting chosen = ops_routing_of(other, options);
  EXPECT_EQ(pinned.topk_index.to_vector<int32_t>(), chosen.topk_index.to_vector<int32_t>());
  EXPECT_EQ(values(pinned.logits), values(free.logits));  // the block's own logits
  Tensor probs = Tensor::empty({kTokens, kExperts}, DType::F32), weight = Tensor::empty({kTokens, kTopK}, DType::F32);
  // Weighed without the group mask: the selection was made under the pinned logits' own.
  ops::RouterParams unmasked = op_params(options);
  unmasked.num_groups = unmasked.topk_groups = 1;
  ops::router_forward_given(Stream::cpu(), probs, chosen.topk_index, weight, free.logits, unmasked);
  EXPECT_EQ(values(pinned.topk_weight), values(weight));
  for (const float w : values(pinned.topk_weight)) EXPECT_TRUE(std::isfinite(w)) << w;
  // The backward takes the same unmasked weighing: every given expert carries its gradient.
  Rng grad_rng(44);
  const Tensor dx = router.backward_input(other_record, pinned, random_tensor({kTokens, kTopK}, DType::F32, grad_rng),
                                          Tensor(), Tensor());
  for (const float v : values(dx)) ASSERT_TRUE(std::isfinite(v)) << v;
  EXPECT_EQ(pinned.plan.expert_offsets.to_vector<int32_t>(),
            ops::make_routing_plan(Stream::cpu(), chosen.topk_index, kExperts).expert_offsets.to_vector<int32_t>());
}

// The routing itself, written out in f64 from the block's logits: probabilities are the softmax (1e-6 relative is
// f32 rounding with margin); the kept groups are those of the largest best probabilities (equal ones in group
// order), the k experts those of the k largest probabilities in the kept groups in descending order, and the
// weights their probabilities, divided by their sum when renormalising, times the scaling factor.
TEST_P(RouterBlock, ForwardSelectsTheLargestSoftmaxProbabilitiesOfTheKeptGroups) {
  const Router router(options, *store, "layers.1.");
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x, Tensor());
  const std::vector<float> logits = values(m.logits), probs = values(m.probs), weights = values(m.topk_weight);
  const std::vector<int32_t> index = m.topk_index.to_vector<int32_t>();
  const int64_t size = kExperts / options.num_groups;
  int changed = 0;  // tokens whose experts differ from the plain top-k
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> p(static_cast<size_t>(kExperts));
    double max = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < kExperts; ++e) max = std::max(max, double(logits[static_cast<size_t>(t * kExperts + e)]));
    for (int64_t e = 0; e < kExperts; ++e) {
      p[static_cast<size_t>(e)] = std::exp(logits[static_cast<size_t>(t * kExperts + e)] - max);
      sum += p[static_cast<size_t>(e)];
    }
    for (double& v : p) v /= sum;
    for (int64_t e = 0; e < kExperts; ++e)
      EXPECT_NEAR(probs[static_cast<size_t>(t * kExperts + e)], p[static_cast<size_t>(e)], 1e-6) << "token " << t;
    std::vector<double> best(static_cast<size_t>(options.num_groups), 0.0);
    for (int64_t e = 0; e < kExperts; ++e) {
      best[static_cast<size_t>(e / size)] = std::max(best[static_cast<size_t>(e / size)], p[static_cast<size_t>(e)]);
    }
    std::vector<int64_t> groups(static_cast<size_t>(options.num_groups));
    std::iota(groups.begin(), groups.end(), 0);
    std::stable_sort(groups.begin(), groups.end(),
                     [&](int64_t a, int64_t b) { return best[size_t(a)] > best[size_t(b)]; });
    groups.resize(static_cast<size_t>(options.topk_groups));
    std::vector<int32_t> candidates, order(static_cast<size_t>(kExperts));
    for (int32_t e = 0; e < kExperts; ++e) {
      if (std::find(groups.begin(), groups.end(), e / size) != groups.end()) candidates.push_back(e);
    }
    const auto by_probability = [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; };
    std::stable_sort(candidates.begin(), candidates.end(), by_probability);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), by_probability);
    if (std::set<int32_t>(candidates.begin(), candidates.begin() + kTopK) !=
        std::set<int32_t>(order.begin(), order.begin() + kTopK)) {
      ++changed;
    }
    double selected = 0.0;
    for (int64_t k = 0; k < kTopK; ++k) {
      EXPECT_EQ(index[static_cast<size_t>(t * kTopK + k)], candidates[static_cast<size_t>(k)]) << "token " << t;
      selected += p[static_cast<size_t>(candidates[static_cast<size_t>(k)])];
    }
    for (int64_t k = 0; k < kTopK; ++k) {
      const double expected = p[static_cast<size_t>(candidates[static_cast<size_t>(k)])] /
                              (options.renormalize ? selected : 1.0) * options.scaling_factor;
      EXPECT_NEAR(weights[static_cast<size_t>(t * kTopK + k)], expected, 1e-6 * options.scaling_factor)
          << "token " << t;
    }
  }
  if (options.topk_groups < options.num_groups) {
    EXPECT_GT(changed, 0) << "the group mask changed no selection";
  }
}

struct OpsBackward {
  Tensor dx, g_w;
};

OpsBackward ops_backward(const Tensor& x, const Tensor& w, const OpsRouting& r, const Tensor& d_topk_weight,
                         const Tensor& d_probs, const Tensor& d_logits_extra, const RouterOptions& o) {
  Stream& s = Stream::cpu();
  Tensor d_logits = Tensor::empty({kTokens, kExperts}, DType::F32);
  ops::router_backward(s, d_logits, d_topk_weight, d_probs, r.probs, r.topk_index, r.topk_weight, op_params(o));
  if (d_logits_extra.defined()) ops::accumulate(s, d_logits, d_logits_extra);
  OpsBackward b{Tensor::empty(x.shape(), DType::F32), Tensor::zeros(w.shape(), DType::F32)};
  ops::linear_backward_input(s, b.dx, d_logits, w);
  ops::linear_backward_weight(s, b.g_w, d_logits, x);
  return b;
}

void expect_backward_is_the_ops(const Router& router, const ParameterStore& store, const Tensor& x, bool with_extras) {
  Rng rng(43);
  const Tensor d_topk_weight = random_tensor({kTokens, kTopK}, DType::F32, rng);
  const Tensor d_probs = with_extras ? random_tensor({kTokens, kExperts}, DType::F32, rng, 0.1) : Tensor();
  const Tensor d_logits_extra = with_extras ? random_tensor({kTokens, kExperts}, DType::F32, rng, 0.1) : Tensor();
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x, Tensor());
  const Tensor dx = router.backward_input(record, m, d_topk_weight, d_probs, d_logits_extra);
  router.backward_weight(record);

  const Tensor w = store.param("layers.1.router");
  const OpsBackward ref =
      ops_backward(x, w, ops_routing(x, w, router.options()), d_topk_weight, d_probs, d_logits_extra, router.options());
  EXPECT_EQ(values(dx), values(ref.dx));
  EXPECT_EQ(values(store.grad("layers.1.router")), values(ref.g_w));
}

TEST_P(RouterBlock, BackwardIsBitwiseRouterBackwardThenTheLinearBackward) {
  const Router router(options, *store, "layers.1.");
  expect_backward_is_the_ops(router, *store, x, /*with_extras=*/false);
}

TEST_P(RouterBlock, BackwardAddsTheLoadBalanceAndZLossGradients) {
  const Router router(options, *store, "layers.1.");
  expect_backward_is_the_ops(router, *store, x, /*with_extras=*/true);
}

INSTANTIATE_TEST_SUITE_P(Options, RouterBlock, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<RouterCase>& info) { return std::string(info.param.name); });

TEST(RouterBlockSpecs, OneRouterMatrixOfRoleRouterInItsLayer) {
  const auto specs = Router::param_specs(router_options(kCases[1]), "layers.4.", 4);
  ASSERT_EQ(specs.size(), 1u);
  EXPECT_EQ(specs[0].name, "layers.4.router");
  EXPECT_EQ(specs[0].shape, (Shape{kExperts, kHidden}));
  EXPECT_EQ(specs[0].role, ParamRole::Router);
  EXPECT_EQ(specs[0].layer, 4);
}

// Builds the router with one option changed on a store holding its parameter, so that only the refusal can make
// construction fail.
std::string refusal(void (*change)(RouterOptions&)) {
  RouterOptions o = router_options(kCases[1]);
  change(o);
  ParameterStore store(with_whole_pieces(Router::param_specs(o, "", 0)));
  return error_message([&] { Router router(o, store, ""); });
}

TEST(RouterBlockOptions, RefusesSigmoidScoresByName) {
  const std::string m = refusal([](RouterOptions& o) { o.score = RouterScore::Sigmoid; });
  EXPECT_TRUE(contains(m, "sigmoid scores")) << m;
}

// GPT-OSS's router: a biased projection, the top-k of the logits (descending), their softmax as the weights, and the
// full softmax as the probabilities the balance losses read. The logits are bitwise linear + bias; the selection and
// weights agree with the formula written out in f64 (1e-6: f32 rounding with margin); the gradients (input, weight,
// bias) are bitwise router_backward and the linear and bias backwards.
TEST(RouterBlockGptOss, BiasedTopKThenSoftmaxIsTheFormulaAndItsGradientsAreTheOps) {
  RouterOptions o = router_options(kCases[0]);
  o.topk_before_softmax = true;
  o.bias = true;
  const auto specs = Router::param_specs(o, "layers.1.", 1);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[1].name, "layers.1.router_bias");
  EXPECT_EQ(specs[1].shape, (Shape{kExperts}));
  EXPECT_EQ(specs[1].role, ParamRole::Router);
  EXPECT_EQ(specs[1].init, ParamInit::Normal);
  ParameterStore store(with_whole_pieces(specs));
  fill_random(store, 51, 0.5);
  Rng rng(52);
  const Tensor x = random_tensor({kTokens, kHidden}, DType::F32, rng);
  const Router router(o, store, "layers.1.");
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x, Tensor());

  Stream& s = Stream::cpu();
  const Tensor w = store.param("layers.1.router"), b = store.param("layers.1.router_bias");
  Tensor logits = Tensor::empty({kTokens, kExperts}, DType::F32);
  ops::linear_forward(s, logits, x, w);
  ops::bias_add(s, logits, b);
  EXPECT_EQ(values(m.logits), values(logits));
  const std::vector<float> z = values(logits), probs = values(m.probs), weights = values(m.topk_weight);
  const std::vector<int32_t> index = m.topk_index.to_vector<int32_t>();
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<int32_t> order(static_cast<size_t>(kExperts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
      return z[static_cast<size_t>(t * kExperts + a)] > z[static_cast<size_t>(t * kExperts + c)];
    });
    double max_all = -INFINITY, sum_all = 0.0, sum_kept = 0.0;
    for (int64_t e = 0; e < kExperts; ++e)
      max_all = std::max(max_all, double(z[static_cast<size_t>(t * kExperts + e)]));
    for (int64_t e = 0; e < kExperts; ++e) sum_all += std::exp(z[static_cast<size_t>(t * kExperts + e)] - max_all);
    for (int64_t e = 0; e < kExperts; ++e) {
      EXPECT_NEAR(probs[static_cast<size_t>(t * kExperts + e)],
                  std::exp(z[static_cast<size_t>(t * kExperts + e)] - max_all) / sum_all, 1e-6);
    }
    const double top = z[static_cast<size_t>(t * kExperts + order[0])];
    for (int64_t k = 0; k < kTopK; ++k)
      sum_kept += std::exp(z[static_cast<size_t>(t * kExperts + order[size_t(k)])] - top);
    for (int64_t k = 0; k < kTopK; ++k) {
      EXPECT_EQ(index[static_cast<size_t>(t * kTopK + k)], order[static_cast<size_t>(k)]) << "token " << t;
      EXPECT_NEAR(weights[static_cast<size_t>(t * kTopK + k)],
                  std::exp(z[static_cast<size_t>(t * kExperts + order[size_t(k)])] - top) / sum_kept, 1e-6);
    }
  }

  const Tensor d_topk_weight = random_tensor({kTokens, kTopK}, DType::F32, rng);
  const Tensor d_probs = random_tensor({kTokens, kExperts}, DType::F32, rng, 0.1);
  const Tensor dx = router.backward_input(record, m, d_topk_weight, d_probs, Tensor());
  router.backward_weight(record);
  ops::RouterParams params = op_params(o);
  params.topk_before_softmax = true;
  Tensor d_logits = Tensor::empty({kTokens, kExperts}, DType::F32);
  ops::router_backward(s, d_logits, d_topk_weight, d_probs, m.probs, m.topk_index, m.topk_weight, params);
  Tensor ref_dx = Tensor::empty(x.shape(), DType::F32), ref_gw = Tensor::zeros(w.shape(), DType::F32),
         ref_gb = Tensor::zeros(b.shape(), DType::F32);
  ops::linear_backward_input(s, ref_dx, d_logits, w);
  ops::linear_backward_weight(s, ref_gw, d_logits, x);
  ops::bias_backward(s, ref_gb, d_logits);
  EXPECT_EQ(values(dx), values(ref_dx));
  EXPECT_EQ(values(store.grad("layers.1.router")), values(ref_gw));
  EXPECT_EQ(values(store.grad("layers.1.router_bias")), values(ref_gb));
}

// Group-limited top-k and the scaling factor run (RouterBlock above); values the op would refuse are refused when
// the block is built, naming them.
TEST(RouterBlockOptions, RefusesInvalidGroupsByNameWithTheirValues) {
  std::string m = refusal([](RouterOptions& o) { o.num_groups = 4; });
  EXPECT_TRUE(contains(m, "router block: E = 6 is not divisible by num_groups (4)")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = 0; });
  EXPECT_TRUE(contains(m, "router block: num_groups (0) must be in [1, E = 6]")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = int64_t{1} << 40; });
  EXPECT_TRUE(contains(m, "router block: num_groups (1099511627776) must be in [1, E = 6]")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = 2, o.topk_groups = 3; });
  EXPECT_TRUE(contains(m, "router block: topk_groups (3) must be in [1, num_groups = 2]")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = 3, o.topk_groups = 0; });
  EXPECT_TRUE(contains(m, "router block: topk_groups (0) must be in [1, num_groups = 3]")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = 6, o.topk_groups = 1; });
  EXPECT_TRUE(contains(m,
                       "router block: top_k (2) exceeds the experts of the kept groups: topk_groups (1) x E / "
                       "num_groups (1) = 1"))
      << m;
}

TEST(RouterBlockOptions, RefusesScalingFactorThatIsNotFinitePositiveWithItsValue) {
  std::string m = refusal([](RouterOptions& o) { o.scaling_factor = 0.0; });
  EXPECT_TRUE(contains(m, "router block: scaling_factor (0) must be finite and > 0")) << m;
  m = refusal([](RouterOptions& o) { o.scaling_factor = -2.5; });
  EXPECT_TRUE(contains(m, "router block: scaling_factor (-2.5) must be finite and > 0")) << m;
  m = refusal([](RouterOptions& o) { o.scaling_factor = INFINITY; });
  EXPECT_TRUE(contains(m, "router block: scaling_factor (inf) must be finite and > 0")) << m;
}

TEST(RouterBlockOptions, RefusesTopKOutsideOneToExperts) {
  std::string m = refusal([](RouterOptions& o) { o.top_k = kExperts + 1; });
  EXPECT_TRUE(contains(m, "top-7 of 6 experts")) << m;
  m = refusal([](RouterOptions& o) { o.top_k = 0; });
  EXPECT_TRUE(contains(m, "top-0 of 6 experts")) << m;
}

}  // namespace
}  // namespace moetrain::model
