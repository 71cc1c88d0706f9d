// Tests for the router block (model/blocks/router.*): its logits, probabilities, top-k, weights and routing plan
// are bitwise ops::router_forward on linear_forward's logits (with and without renormalisation) and agree with a
// softmax and a selection written out here; its input and weight gradients are bitwise ops::router_backward and the
// linear backward (with and without the load-balance and z-loss gradients); the options it does not run are
// refused by name.
#include "model/blocks/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
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

RouterOptions router_options(bool renormalize) {
  RouterOptions o;
  o.hidden_size = kHidden;
  o.num_experts = kExperts;
  o.top_k = kTopK;
  o.renormalize = renormalize;
  return o;
}

struct OpsRouting {
  Tensor logits, probs, topk_index, topk_weight;
};

OpsRouting ops_routing(const Tensor& x, const Tensor& w, bool renormalize) {
  Stream& s = Stream::cpu();
  OpsRouting r{Tensor::empty({kTokens, kExperts}, DType::F32), Tensor::empty({kTokens, kExperts}, DType::F32),
               Tensor::empty({kTokens, kTopK}, DType::I32), Tensor::empty({kTokens, kTopK}, DType::F32)};
  ops::linear_forward(s, r.logits, x, w);
  ops::router_forward(s, r.probs, r.topk_index, r.topk_weight, r.logits, {static_cast<int>(kTopK), renormalize});
  return r;
}

class RouterBlock : public ::testing::TestWithParam<bool> {
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
  const RoutingMetadata m = router.forward(record, x);
  ASSERT_TRUE(m.defined());
  const OpsRouting ref = ops_routing(x, store->param("layers.1.router"), options.renormalize);
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

// The routing itself, written out in f64 from the block's logits: probabilities are the softmax (1e-6 relative is
// f32 rounding with margin), the k experts are those of the k largest probabilities in descending order, and the
// weights are their probabilities, divided by their sum when renormalising.
TEST_P(RouterBlock, ForwardSelectsTheLargestSoftmaxProbabilities) {
  const Router router(options, *store, "layers.1.");
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x);
  const std::vector<float> logits = values(m.logits), probs = values(m.probs), weights = values(m.topk_weight);
  const std::vector<int32_t> index = m.topk_index.to_vector<int32_t>();
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
    std::vector<int32_t> order(static_cast<size_t>(kExperts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
    double selected = 0.0;
    for (int64_t k = 0; k < kTopK; ++k) {
      EXPECT_EQ(index[static_cast<size_t>(t * kTopK + k)], order[static_cast<size_t>(k)]) << "token " << t;
      selected += p[static_cast<size_t>(order[static_cast<size_t>(k)])];
    }
    for (int64_t k = 0; k < kTopK; ++k) {
      const double expected =
          p[static_cast<size_t>(order[static_cast<size_t>(k)])] / (options.renormalize ? selected : 1.0);
      EXPECT_NEAR(weights[static_cast<size_t>(t * kTopK + k)], expected, 1e-6) << "token " << t;
    }
  }
}

struct OpsBackward {
  Tensor dx, g_w;
};

OpsBackward ops_backward(const Tensor& x, const Tensor& w, const OpsRouting& r, const Tensor& d_topk_weight,
                         const Tensor& d_probs, const Tensor& d_logits_extra, bool renormalize) {
  Stream& s = Stream::cpu();
  Tensor d_logits = Tensor::empty({kTokens, kExperts}, DType::F32);
  ops::router_backward(s, d_logits, d_topk_weight, d_probs, r.probs, r.topk_index, r.topk_weight,
                       {static_cast<int>(kTopK), renormalize});
  if (d_logits_extra.defined()) ops::accumulate(s, d_logits, d_logits_extra);
  OpsBackward b{Tensor::empty(x.shape(), DType::F32), Tensor::zeros(w.shape(), DType::F32)};
  ops::linear_backward_input(s, b.dx, d_logits, w);
  ops::linear_backward_weight(s, b.g_w, d_logits, x);
  return b;
}

void expect_backward_is_the_ops(const Router& router, const ParameterStore& store, const Tensor& x, bool renormalize,
                                bool with_extras) {
  Rng rng(43);
  const Tensor d_topk_weight = random_tensor({kTokens, kTopK}, DType::F32, rng);
  const Tensor d_probs = with_extras ? random_tensor({kTokens, kExperts}, DType::F32, rng, 0.1) : Tensor();
  const Tensor d_logits_extra = with_extras ? random_tensor({kTokens, kExperts}, DType::F32, rng, 0.1) : Tensor();
  RouterRecord record;
  const RoutingMetadata m = router.forward(record, x);
  const Tensor dx = router.backward_input(record, m, d_topk_weight, d_probs, d_logits_extra);
  router.backward_weight(record);

  const Tensor w = store.param("layers.1.router");
  const OpsBackward ref =
      ops_backward(x, w, ops_routing(x, w, renormalize), d_topk_weight, d_probs, d_logits_extra, renormalize);
  EXPECT_EQ(values(dx), values(ref.dx));
  EXPECT_EQ(values(store.grad("layers.1.router")), values(ref.g_w));
}

TEST_P(RouterBlock, BackwardIsBitwiseRouterBackwardThenTheLinearBackward) {
  const Router router(options, *store, "layers.1.");
  expect_backward_is_the_ops(router, *store, x, options.renormalize, /*with_extras=*/false);
}

TEST_P(RouterBlock, BackwardAddsTheLoadBalanceAndZLossGradients) {
  const Router router(options, *store, "layers.1.");
  expect_backward_is_the_ops(router, *store, x, options.renormalize, /*with_extras=*/true);
}

INSTANTIATE_TEST_SUITE_P(Renormalize, RouterBlock, ::testing::Bool(), [](const ::testing::TestParamInfo<bool>& info) {
  return info.param ? std::string("Renormalized") : std::string("Plain");
});

TEST(RouterBlockSpecs, OneRouterMatrixOfRoleRouterInItsLayer) {
  const auto specs = Router::param_specs(router_options(true), "layers.4.", 4);
  ASSERT_EQ(specs.size(), 1u);
  EXPECT_EQ(specs[0].name, "layers.4.router");
  EXPECT_EQ(specs[0].shape, (Shape{kExperts, kHidden}));
  EXPECT_EQ(specs[0].role, ParamRole::Router);
  EXPECT_EQ(specs[0].layer, 4);
}

// Builds the router with one option changed on a store holding its parameter, so that only the refusal can make
// construction fail.
std::string refusal(void (*change)(RouterOptions&)) {
  RouterOptions o = router_options(true);
  change(o);
  ParameterStore store(with_whole_pieces(Router::param_specs(o, "", 0)));
  return error_message([&] { Router router(o, store, ""); });
}

TEST(RouterBlockOptions, RefusesSigmoidScoresByName) {
  const std::string m = refusal([](RouterOptions& o) { o.score = RouterScore::Sigmoid; });
  EXPECT_TRUE(contains(m, "sigmoid scores")) << m;
}

TEST(RouterBlockOptions, RefusesTopKBeforeSoftmaxByName) {
  const std::string m = refusal([](RouterOptions& o) { o.topk_before_softmax = true; });
  EXPECT_TRUE(contains(m, "top-k before the softmax")) << m;
}

TEST(RouterBlockOptions, RefusesRouterBiasByName) {
  const std::string m = refusal([](RouterOptions& o) { o.bias = true; });
  EXPECT_TRUE(contains(m, "router bias")) << m;
}

TEST(RouterBlockOptions, RefusesGroupLimitedTopKByNameWithItsGroups) {
  std::string m = refusal([](RouterOptions& o) { o.num_groups = 3, o.topk_groups = 2; });
  EXPECT_TRUE(contains(m, "group-limited top-k (3 groups, 2 kept)")) << m;
  m = refusal([](RouterOptions& o) { o.num_groups = 2; });
  EXPECT_TRUE(contains(m, "group-limited top-k (2 groups, 1 kept)")) << m;
}

TEST(RouterBlockOptions, RefusesScalingFactorByNameWithItsValue) {
  const std::string m = refusal([](RouterOptions& o) { o.scaling_factor = 2.5; });
  EXPECT_TRUE(contains(m, "routed scaling factor (2.5)")) << m;
}

TEST(RouterBlockOptions, RefusesTopKOutsideOneToExperts) {
  std::string m = refusal([](RouterOptions& o) { o.top_k = kExperts + 1; });
  EXPECT_TRUE(contains(m, "top-7 of 6 experts")) << m;
  m = refusal([](RouterOptions& o) { o.top_k = 0; });
  EXPECT_TRUE(contains(m, "top-0 of 6 experts")) << m;
}

}  // namespace
}  // namespace moetrain::model
