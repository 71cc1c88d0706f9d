// Tests for model/router_loss: the load-balance and z-loss values, their normalisation (1.0 is
// balanced) and the gradients they inject (checked against differences of the loss they define).
#include "model/router_loss.h"

#include <cmath>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "testing/test_data.h"

namespace moetrain::model {
namespace {

struct Routing {
  Tensor logits, probs, topk, cu;
};

// T tokens, E experts, top-K by descending logit; cu_seqlens splits the tokens into two documents.
Routing make_routing(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  Rng rng(seed);
  Routing r;
  r.logits = testing::random_tensor({T, E}, DType::F32, rng);
  r.probs = Tensor::empty({T, E}, DType::F32);
  r.topk = Tensor::empty({T, K}, DType::I32);
  for (int64_t t = 0; t < T; ++t) {
    const float* z = r.logits.data<float>() + t * E;
    double total = 0.0;
    for (int64_t e = 0; e < E; ++e) total += std::exp(double(z[e]));
    std::vector<int> order(E);
    for (int64_t e = 0; e < E; ++e) {
      r.probs.data<float>()[t * E + e] = float(std::exp(double(z[e])) / total);
      order[e] = int(e);
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    for (int64_t k = 0; k < K; ++k) r.topk.data<int32_t>()[t * K + k] = order[k];
  }
  r.cu = Tensor::from_vector<int32_t>({0, int32_t(T / 3), int32_t(T)}, {3});
  return r;
}

RouterLossSettings settings(LoadBalanceVariant variant, double lb, double z) {
  RouterLossSettings s;
  s.variant = variant;
  s.load_balance_coef = lb;
  s.z_loss_coef = z;
  s.loss_scale = 1.0 / 50.0;
  s.num_moe_layers = 2;
  return s;
}

TEST(RouterLoss, PerfectBalanceIsOne) {
  // 4 tokens, 4 experts, top-1, every expert once, uniform probabilities.
  Tensor logits = Tensor::zeros({4, 4}, DType::F32);
  Tensor probs = Tensor::from_vector<float>(std::vector<float>(16, 0.25f), {4, 4});
  Tensor topk = Tensor::from_vector<int32_t>({0, 1, 2, 3}, {4, 1});
  Tensor cu = Tensor::from_vector<int32_t>({0, 4}, {2});
  Tensor dp, dz;
  const auto v =
      router_aux_losses(settings(LoadBalanceVariant::MicroBatch, 1.0, 0.0), 0, logits, probs, topk, cu, dp, dz);
  EXPECT_NEAR(v.load_balance, 1.0, 1e-12);
}

TEST(RouterLoss, CollapsedRoutingIsNumberOfExperts) {
  Tensor logits = Tensor::zeros({4, 4}, DType::F32);
  std::vector<float> p(16, 0.0f);
  for (int t = 0; t < 4; ++t) p[t * 4] = 1.0f;
  Tensor probs = Tensor::from_vector(p, {4, 4});
  Tensor topk = Tensor::from_vector<int32_t>({0, 0, 0, 0}, {4, 1});
  Tensor cu = Tensor::from_vector<int32_t>({0, 4}, {2});
  Tensor dp, dz;
  const auto v =
      router_aux_losses(settings(LoadBalanceVariant::MicroBatch, 1.0, 0.0), 0, logits, probs, topk, cu, dp, dz);
  EXPECT_NEAR(v.load_balance, 4.0, 1e-12);
}

// The load-balance loss is linear in the probabilities once the selection is fixed, so its
// gradient is exactly the difference quotient with any step.
TEST(RouterLoss, LoadBalanceGradientIsTheLossSlopeForEveryVariant) {
  const int64_t T = 12, E = 6, K = 2;
  const Routing r = make_routing(T, E, K, 3);
  for (auto variant : {LoadBalanceVariant::MicroBatch, LoadBalanceVariant::Sequence}) {
    const RouterLossSettings s = settings(variant, 0.3, 0.0);
    Tensor dp, dz;
    const auto base = router_aux_losses(s, 0, r.logits, r.probs, r.topk, r.cu, dp, dz);
    // Contribution to the step loss: coef * scale / layers * tokens * value.
    auto contribution = [&](const RouterLossValues& v) {
      return s.load_balance_coef * s.loss_scale / double(s.num_moe_layers) * double(v.tokens) * v.load_balance;
    };
    for (int64_t i = 0; i < T * E; i += 7) {
      Tensor bumped = r.probs.clone();
      bumped.data<float>()[i] += 0.5f;
      Tensor dp2, dz2;
      const auto v = router_aux_losses(s, 0, r.logits, bumped, r.topk, r.cu, dp2, dz2);
      EXPECT_NEAR((contribution(v) - contribution(base)) / 0.5, dp.data<float>()[i], 1e-7) << i;
    }
  }
}

TEST(RouterLoss, ZLossGradientMatchesFiniteDifferences) {
  const int64_t T = 5, E = 4, K = 1;
  const Routing r = make_routing(T, E, K, 9);
  const RouterLossSettings s = settings(LoadBalanceVariant::MicroBatch, 0.0, 0.2);
  Tensor dp, dz;
  const auto v = router_aux_losses(s, 0, r.logits, r.probs, r.topk, r.cu, dp, dz);
  // The z-loss contribution in f64, computed here from its definition.
  auto contribution = [&](const std::vector<double>& z) {
    double sum = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      double total = 0.0;
      for (int64_t e = 0; e < E; ++e) total += std::exp(z[t * E + e]);
      sum += std::log(total) * std::log(total);
    }
    return s.z_loss_coef * s.loss_scale / double(s.num_moe_layers) * sum;
  };
  std::vector<double> z(r.logits.data<float>(), r.logits.data<float>() + T * E);
  EXPECT_NEAR(v.z_loss * T * s.z_loss_coef * s.loss_scale / 2.0, contribution(z), 1e-9);
  for (int64_t i = 0; i < T * E; ++i) {
    auto plus = z, minus = z;
    plus[i] += 1e-5;
    minus[i] -= 1e-5;
    EXPECT_NEAR((contribution(plus) - contribution(minus)) / 2e-5, dz.data<float>()[i], 1e-7) << i;
  }
}

TEST(RouterLoss, GlobalBatchUsesCountsOfTheStepSoFar) {
  const Routing a = make_routing(8, 4, 1, 1), b = make_routing(8, 4, 1, 2);
  std::vector<Tensor> running(1);
  RouterLossSettings s = settings(LoadBalanceVariant::GlobalBatch, 1.0, 0.0);
  s.running_counts = &running;
  Tensor dp, dz;
  router_aux_losses(s, 0, a.logits, a.probs, a.topk, a.cu, dp, dz);
  router_aux_losses(s, 0, b.logits, b.probs, b.topk, b.cu, dp, dz);
  std::vector<int32_t> expected(4, 0);
  for (const Routing* r : {&a, &b}) {
    for (int64_t t = 0; t < 8; ++t) expected[r->topk.data<int32_t>()[t]] += 1;
  }
  ASSERT_TRUE(running[0].defined());
  EXPECT_EQ(running[0].to_vector<int32_t>(), expected);
  // On the last micro-batch the injected gradient is E * f_e(global) * coef * scale / layers.
  for (int64_t e = 0; e < 4; ++e) {
    EXPECT_NEAR(dp.data<float>()[e], 4.0 * expected[e] / 16.0 * s.loss_scale / 2.0, 1e-9);
  }
}

// Sequence variant: each document is its own balance set, so a document's value and gradient are those of the
// micro_batch variant run on that document alone (length-1 documents included).
TEST(RouterLoss, SequenceVariantIsMicroBatchPerDocument) {
  const int64_t T = 9, E = 5, K = 2;
  const Routing r = make_routing(T, E, K, 17);
  const std::vector<int32_t> cu = {0, 1, 5, 6, 9};
  const RouterLossSettings seq = settings(LoadBalanceVariant::Sequence, 0.7, 0.0);
  const RouterLossSettings micro = settings(LoadBalanceVariant::MicroBatch, 0.7, 0.0);
  Tensor dp, dz;
  const auto v = router_aux_losses(seq, 0, r.logits, r.probs, r.topk, Tensor::from_vector(cu, {5}), dp, dz);
  double expected = 0.0;
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t b = cu[d], n = cu[d + 1] - cu[d];
    Tensor dp_doc, dz_doc;
    const auto doc = router_aux_losses(micro, 0, r.logits.slice(b, b + n).clone(), r.probs.slice(b, b + n).clone(),
                                       r.topk.slice(b, b + n).clone(),
                                       Tensor::from_vector<int32_t>({0, int32_t(n)}, {2}), dp_doc, dz_doc);
    expected += doc.load_balance * double(n) / double(T);
    for (int64_t i = 0; i < n * E; ++i)
      EXPECT_EQ(dp.data<float>()[b * E + i], dp_doc.data<float>()[i]) << d << " " << i;
  }
  EXPECT_NEAR(v.load_balance, expected, 1e-12);
}

TEST(RouterLoss, RejectsBadArguments) {
  const Routing r = make_routing(6, 4, 2, 5);
  const RouterLossSettings s = settings(LoadBalanceVariant::MicroBatch, 1.0, 1.0);
  Tensor dp, dz;
  auto expect_error = [&](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { router_aux_losses(s, 0, r.logits, r.probs.slice(0, 5).clone(), r.topk, r.cu, dp, dz); }, "probs");
  expect_error([&] { router_aux_losses(s, 0, r.logits, r.probs, r.topk.to(DType::F32), r.cu, dp, dz); }, "topk_index");
  Tensor bad = r.topk.clone();
  bad.data<int32_t>()[3] = 4;
  expect_error([&] { router_aux_losses(s, 0, r.logits, r.probs, bad, r.cu, dp, dz); }, "outside [0, E = 4)");
  RouterLossSettings global = settings(LoadBalanceVariant::GlobalBatch, 1.0, 0.0);
  expect_error([&] { router_aux_losses(global, 0, r.logits, r.probs, r.topk, r.cu, dp, dz); }, "running expert counts");
  std::vector<Tensor> running = {Tensor::zeros({5}, DType::I32)};
  global.running_counts = &running;
  expect_error([&] { router_aux_losses(global, 0, r.logits, r.probs, r.topk, r.cu, dp, dz); }, "running expert counts");
}

TEST(RouterLoss, RejectsUnknownVariant) { EXPECT_THROW(parse_load_balance_variant("batch"), Error); }

}  // namespace
}  // namespace moetrain::model
