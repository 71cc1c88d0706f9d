// Tests for model/router_loss: the load-balance, device-balance and z-loss values, their normalisation
// (1.0 is balanced) and the gradients they inject (checked against differences of the loss they define).
#include "model/router_loss.h"

#include <cmath>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using testing::expect_error;

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

// ---- DeepSeek-V2's device-level balance ----

RouterLossSettings device_settings(double coef, int64_t groups) {
  RouterLossSettings s = settings(LoadBalanceVariant::MicroBatch, 0.0, 0.0);
  s.device_balance_coef = coef;
  s.device_balance_groups = groups;
  return s;
}

// The paper's definition (DeepSeek-V2, section 2.2) in f64, straight from the routing: f_j = E / (K T) * the
// choices of j, P_j = the mean probability of j, f'_i = the mean of f_j over group i, P'_i = the sum of P_j over it;
// the loss divided by alpha2 is sum_i f'_i * P'_i. Also the gradient's group fractions F_i = choices of i / (T K).
struct DeviceReference {
  double value = 0.0;
  std::vector<double> group_fraction;
};

DeviceReference device_reference(const Routing& r, int64_t D) {
  const int64_t T = r.probs.size(0), E = r.probs.size(1), K = r.topk.size(1), per = E / D;
  std::vector<int64_t> chosen(static_cast<size_t>(E), 0);
  std::vector<double> mean_prob(static_cast<size_t>(E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) chosen[static_cast<size_t>(r.topk.data<int32_t>()[t * K + k])] += 1;
    for (int64_t e = 0; e < E; ++e) mean_prob[size_t(e)] += double(r.probs.data<float>()[t * E + e]) / double(T);
  }
  DeviceReference ref;
  for (int64_t i = 0; i < D; ++i) {
    double f_mean = 0.0, p_sum = 0.0;
    int64_t group_chosen = 0;
    for (int64_t e = i * per; e < (i + 1) * per; ++e) {
      f_mean += double(E) / double(K * T) * double(chosen[size_t(e)]) / double(per);
      p_sum += mean_prob[size_t(e)];
      group_chosen += chosen[size_t(e)];
    }
    ref.value += f_mean * p_sum;
    ref.group_fraction.push_back(double(group_chosen) / double(T * K));
  }
  return ref;
}

struct DeviceCase {
  int64_t T, E, K, D;
};

// Several T, K and D (one group, several, one per expert), against the paper's formula: the value (f64 sums in
// another order: 1e-12) and the gradient coef * D * F_group(e) * layer_scale (rounded to f32 once: 1 f32 ulp).
TEST(RouterLoss, DeviceBalanceMatchesThePaperFormula) {
  const std::vector<DeviceCase> cases = {{12, 8, 2, 1}, {12, 8, 2, 2}, {12, 8, 2, 4},  {12, 8, 2, 8}, {7, 6, 3, 2},
                                         {7, 6, 3, 3},  {1, 4, 1, 2},  {33, 16, 4, 4}, {50, 64, 6, 8}};
  for (const DeviceCase& c : cases) {
    const std::string what = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
                             " D=" + std::to_string(c.D);
    SCOPED_TRACE(what);
    const Routing r = make_routing(c.T, c.E, c.K, 100 + uint64_t(c.T * c.D));
    const RouterLossSettings s = device_settings(0.05, c.D);
    Tensor dp, dz;
    const auto v = router_aux_losses(s, 0, r.logits, r.probs, r.topk, r.cu, dp, dz);
    const DeviceReference ref = device_reference(r, c.D);
    EXPECT_NEAR(v.device_balance, ref.value, 1e-12 * ref.value);
    EXPECT_EQ(v.load_balance, 0.0);
    EXPECT_EQ(v.z_loss, 0.0);
    const double layer_scale = s.loss_scale / double(s.num_moe_layers);
    const int64_t per = c.E / c.D;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t e = 0; e < c.E; ++e) {
        const double want = s.device_balance_coef * double(c.D) * ref.group_fraction[size_t(e / per)] * layer_scale;
        EXPECT_FLOAT_EQ(dp.data<float>()[t * c.E + e], float(want)) << t << " " << e;
      }
    }
    EXPECT_TRUE(testing::same_bytes(dz, Tensor::zeros({c.T, c.E}, DType::F32))) << "no z-loss, no d_logits";
  }
}

// 1.0 when the groups are balanced (each group gets its share of the choices and of the probability), D when
// every choice and all the probability go to one group.
TEST(RouterLoss, DeviceBalanceIsOneWhenBalancedAndDWhenCollapsed) {
  Tensor logits = Tensor::zeros({4, 4}, DType::F32);
  Tensor uniform = Tensor::from_vector<float>(std::vector<float>(16, 0.25f), {4, 4});
  // Experts 0 and 1 form group 0: balanced over the 2 groups although expert 1 and 3 are never chosen.
  Tensor topk = Tensor::from_vector<int32_t>({0, 2, 0, 2}, {4, 1});
  Tensor cu = Tensor::from_vector<int32_t>({0, 4}, {2});
  Tensor dp, dz;
  EXPECT_NEAR(router_aux_losses(device_settings(1.0, 2), 0, logits, uniform, topk, cu, dp, dz).device_balance, 1.0,
              1e-12);
  std::vector<float> p(16, 0.0f);
  for (int t = 0; t < 4; ++t) p[t * 4 + 3] = 1.0f;
  Tensor collapsed = Tensor::from_vector(p, {4, 4});
  Tensor last = Tensor::from_vector<int32_t>({3, 3, 3, 3}, {4, 1});
  EXPECT_NEAR(router_aux_losses(device_settings(1.0, 2), 0, logits, collapsed, last, cu, dp, dz).device_balance, 2.0,
              1e-12);
  EXPECT_NEAR(router_aux_losses(device_settings(1.0, 4), 0, logits, collapsed, last, cu, dp, dz).device_balance, 4.0,
              1e-12);
}

// D = E: every group is one expert, and the value and gradient are the micro_batch load balance's (the same f64
// expressions: the gradient bitwise; the value up to the load balance's n / T weighting of its one set, 4 ulps).
TEST(RouterLoss, DeviceBalanceWithOneGroupPerExpertIsTheMicroBatchLoadBalance) {
  for (const auto& [T, E, K] : {std::tuple{12, 6, 2}, std::tuple{40, 16, 4}, std::tuple{1, 3, 1}}) {
    const Routing r = make_routing(T, E, K, 7 + uint64_t(T));
    const RouterLossSettings micro = settings(LoadBalanceVariant::MicroBatch, 0.3, 0.0);
    const RouterLossSettings device = device_settings(0.3, E);
    Tensor dp_lb, dp_dev, dz;
    const auto lb = router_aux_losses(micro, 0, r.logits, r.probs, r.topk, r.cu, dp_lb, dz);
    const auto dev = router_aux_losses(device, 0, r.logits, r.probs, r.topk, r.cu, dp_dev, dz);
    EXPECT_DOUBLE_EQ(dev.device_balance, lb.load_balance) << "T=" << T;
    EXPECT_TRUE(testing::same_bytes(dp_dev, dp_lb)) << "T=" << T;
  }
}

// D = 1: one group holds every expert, so F = 1 and the value is the mean over tokens of sum_e p[t, e]: 1 for
// softmax probabilities (rows sum to 1 up to f32 rounding: 1e-6) whatever the routing, the mean row sum otherwise.
// The gradient is the same constant coef * layer_scale on every probability, which a softmax router turns into
// zero on its logits (sum_e p_e * (c - sum_e' p_e' * c) = 0): the loss pushes nothing then.
TEST(RouterLoss, DeviceBalanceWithOneGroupIsTheProbabilityMass) {
  const int64_t T = 10, E = 6, K = 2;
  const Routing r = make_routing(T, E, K, 29);
  const RouterLossSettings s = device_settings(0.4, 1);
  Tensor dp, dz;
  EXPECT_NEAR(router_aux_losses(s, 0, r.logits, r.probs, r.topk, r.cu, dp, dz).device_balance, 1.0, 1e-6);
  // F is 1 up to the f64 rounding of its T * K increments of 1 / (T K): the same bits everywhere, 1 ulp near 1.
  const float constant = float(s.device_balance_coef * s.loss_scale / double(s.num_moe_layers));
  for (int64_t i = 0; i < T * E; ++i) {
    EXPECT_EQ(dp.data<float>()[i], dp.data<float>()[0]) << i;
    EXPECT_FLOAT_EQ(dp.data<float>()[i], constant) << i;
  }
  // Rows scaled by 1 + t / 10 (a router without normalised probabilities, e.g. sigmoid scores).
  Tensor scaled = r.probs.clone();
  double mean_row_sum = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    double row = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      scaled.data<float>()[t * E + e] *= float(1.0 + double(t) / 10.0);
      row += scaled.data<float>()[t * E + e];
    }
    mean_row_sum += row / double(T);
  }
  EXPECT_NEAR(router_aux_losses(s, 0, r.logits, scaled, r.topk, r.cu, dp, dz).device_balance, mean_row_sum, 1e-12);
}

// The device balance is linear in the probabilities once the selection is fixed, so its gradient is exactly the
// difference quotient with any step; f32 rounding of d_probs leaves a relative 6e-8 (bound: 1e-7).
TEST(RouterLoss, DeviceBalanceGradientIsTheLossSlope) {
  const int64_t T = 12, E = 8, K = 2;
  const Routing r = make_routing(T, E, K, 41);
  for (int64_t D : {2, 4}) {
    const RouterLossSettings s = device_settings(0.3, D);
    Tensor dp, dz;
    const auto base = router_aux_losses(s, 0, r.logits, r.probs, r.topk, r.cu, dp, dz);
    auto contribution = [&](const RouterLossValues& v) {
      return s.device_balance_coef * s.loss_scale / double(s.num_moe_layers) * double(v.tokens) * v.device_balance;
    };
    for (int64_t i = 0; i < T * E; i += 5) {
      Tensor bumped = r.probs.clone();
      bumped.data<float>()[i] += 0.5f;
      Tensor dp2, dz2;
      const auto v = router_aux_losses(s, 0, r.logits, bumped, r.topk, r.cu, dp2, dz2);
      const double slope = (contribution(v) - contribution(base)) / 0.5;
      EXPECT_NEAR(slope, dp.data<float>()[i], 1e-7 * std::abs(slope)) << "D=" << D << " " << i;
    }
  }
}

// With the load balance (any variant) and the z-loss on too: the device value is the micro-batch's whatever the
// load balance's sets, the other values are unchanged, and d_probs is the sum of both terms (added in f64, rounded
// once: within 1 f32 ulp of the sum of the two separate f32 gradients).
TEST(RouterLoss, DeviceBalanceAddsToTheLoadBalanceOfEveryVariant) {
  const int64_t T = 15, E = 8, K = 2, D = 4;
  const Routing r = make_routing(T, E, K, 53);
  Tensor dp_dev, dz;
  const auto dev = router_aux_losses(device_settings(0.05, D), 0, r.logits, r.probs, r.topk, r.cu, dp_dev, dz);
  for (auto variant : {LoadBalanceVariant::MicroBatch, LoadBalanceVariant::Sequence, LoadBalanceVariant::GlobalBatch}) {
    std::vector<Tensor> running_alone(1), running_both(1);
    RouterLossSettings alone = settings(variant, 0.01, 0.001);
    alone.running_counts = &running_alone;
    RouterLossSettings both = alone;
    both.running_counts = &running_both;
    both.device_balance_coef = 0.05;
    both.device_balance_groups = D;
    Tensor dp_lb, dz_lb, dp_both, dz_both;
    const auto lb = router_aux_losses(alone, 0, r.logits, r.probs, r.topk, r.cu, dp_lb, dz_lb);
    const auto all = router_aux_losses(both, 0, r.logits, r.probs, r.topk, r.cu, dp_both, dz_both);
    EXPECT_EQ(all.load_balance, lb.load_balance);
    EXPECT_EQ(all.z_loss, lb.z_loss);
    EXPECT_EQ(all.device_balance, dev.device_balance);
    EXPECT_TRUE(testing::same_bytes(dz_both, dz_lb));
    for (int64_t i = 0; i < T * E; ++i) {
      const double sum = double(dp_lb.data<float>()[i]) + double(dp_dev.data<float>()[i]);
      EXPECT_NEAR(dp_both.data<float>()[i], sum, 1.2e-7 * sum) << i;
    }
  }
}

TEST(RouterLoss, DeviceBalanceRejectsGroupsThatDoNotDivideTheExperts) {
  const Routing r = make_routing(6, 8, 2, 5);
  Tensor dp, dz;
  for (int64_t D : {0, 3, 16}) {
    testing::expect_error(
        [&] { router_aux_losses(device_settings(0.1, D), 0, r.logits, r.probs, r.topk, r.cu, dp, dz); },
        {"device-level balance", "E = 8", "D = " + std::to_string(D), "loss.device_balance_groups"});
  }
  // Off (coefficient 0): the groups are not read.
  EXPECT_NO_THROW(router_aux_losses(device_settings(0.0, 3), 0, r.logits, r.probs, r.topk, r.cu, dp, dz));
}

TEST(RouterLoss, DeviceBalanceGroupsDefaultToTheExpertParallelDegree) {
  EXPECT_EQ(resolve_device_balance_groups(0, 4, 64), 4);
  EXPECT_EQ(resolve_device_balance_groups(0, 1, 64), 1);
  EXPECT_EQ(resolve_device_balance_groups(8, 2, 64), 8);
  EXPECT_EQ(resolve_device_balance_groups(64, 1, 64), 64);
  EXPECT_EQ(resolve_device_balance_groups(3, 1, 0), 3) << "a model without experts computes no router loss";
  testing::expect_error([] { resolve_device_balance_groups(3, 1, 64); },
                        {"loss.device_balance_groups", "3 groups", "64 experts", "divisor of 64"});
  testing::expect_error([] { resolve_device_balance_groups(0, 3, 64); },
                        {"3 groups", "expert-parallel degree", "64 experts"});
  testing::expect_error([] { resolve_device_balance_groups(-1, 1, 64); }, {"loss.device_balance_groups", ">= 0", "-1"});
}

TEST(RouterLoss, RejectsUnknownVariant) { EXPECT_THROW(parse_load_balance_variant("batch"), Error); }

}  // namespace
}  // namespace moetrain::model
