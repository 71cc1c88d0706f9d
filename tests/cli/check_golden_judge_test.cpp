// Tests for check-golden's judgement (cli/check_golden_judge.*), none needing a GPU: the bf16 bound (1.5 x
// transformers' own bf16 error + 2^-8, per tensor), the report lines of both rules, the yardstick read from a dump
// (a missing bf16ref tensor is an error naming it), the loss yardstick, top-k flips and their near-tie
// explanation, which tensors of a free pass the routing-pinned pass excuses, and the rounding ensemble's statistics.
#include "cli/check_golden_judge.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "testing/test_data.h"

namespace moetrain::cli::golden {
namespace {

using ::testing::internal::CaptureStdout;
using ::testing::internal::GetCapturedStdout;

// Runs `body` against a fresh Report and returns what it printed.
template <typename Body>
std::string printed(Report& report, Body body) {
  CaptureStdout();
  body(report);
  return GetCapturedStdout();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(CheckGoldenJudge, Bf16BoundIsOneAndAHalfTimesTheirsPlusOneBf16Rounding) {
  EXPECT_DOUBLE_EQ(kBf16Floor, std::ldexp(1.0, -8));
  EXPECT_DOUBLE_EQ(bf16_bound(0.0), kBf16Floor);
  EXPECT_DOUBLE_EQ(bf16_bound(0.02), 1.5 * 0.02 + 1.0 / 256.0);
  const Judged at = judge_bf16("t", bf16_bound(0.02), 0.02);
  EXPECT_TRUE(at.within());  // the bound itself passes
  EXPECT_FALSE(judge_bf16("t", std::nextafter(bf16_bound(0.02), 1.0), 0.02).within());
  EXPECT_FALSE(judge_bf16("t", NAN, 0.02).within());
}

// A bound widened by the rounding ensemble: kEnsembleSpreads spreads on top, and the every-tensor line shows the
// spread.
TEST(CheckGoldenJudge, WideningAddsFourSpreadsAndTheListingShowsTheSpread) {
  Judged t = judge_bf16("model.layers.0.linear_attn.A_log", 0.30, 0.10);
  EXPECT_FALSE(t.within());  // 0.30 against 0.1539
  EXPECT_DOUBLE_EQ(t.spread, -1.0);
  widen_by_spread(t, 0.05);
  EXPECT_DOUBLE_EQ(t.bound, bf16_bound(0.10) + kEnsembleSpreads * 0.05);
  EXPECT_DOUBLE_EQ(t.spread, 0.05);
  EXPECT_TRUE(t.within());
  Report every(/*every_tensor=*/true);
  const std::string out = printed(every, [&](Report& r) { r.judged("batch/grads", {t}, "theirs", "rule"); });
  EXPECT_TRUE(contains(out, "(0.85 of it) model.layers.0.linear_attn.A_log spread 5.000e-02\n")) << out;
}

TEST(CheckGoldenJudge, GroupPassesWhenEveryTensorIsWithinItsBound) {
  Report report;
  const std::string out = printed(report, [](Report& r) {
    r.judged("batch/grads", {judge_bf16("a", 0.010, 0.010), judge_bf16("b", 0.020, 0.015)}, "theirs", "rule");
  });
  EXPECT_EQ(report.passed(), 1);
  EXPECT_EQ(report.failed(), 0);
  // The line names the tensor nearest its bound, with ours, theirs and the bound: b (0.020 against 0.02641).
  EXPECT_TRUE(contains(out, "[ ok ] batch/grads")) << out;
  EXPECT_TRUE(contains(out, "ours 2.000e-02 theirs 1.500e-02 bound 2.641e-02 in b [2 tensor(s); bound = rule]")) << out;
}

TEST(CheckGoldenJudge, EveryTensorReportPrintsEachTensorAfterItsGroupLine) {
  const auto judge = [](Report& r) {
    r.judged("batch/grads", {judge_bf16("a", 0.010, 0.010), judge_bf16("b", 0.050, 0.010)}, "theirs", "rule");
  };
  Report every(/*every_tensor=*/true);
  const std::string out = printed(every, judge);
  EXPECT_EQ(every.failed(), 1);  // the listing changes nothing that is judged
  EXPECT_EQ(every.passed(), 0);
  const size_t group = out.find("[FAIL] batch/grads");
  const size_t a = out.find(
      "[info] batch/grads                  ours 1.000e-02 theirs 1.000e-02 bound 1.891e-02 "
      "(0.53 of it) a\n");
  const size_t b = out.find(
      "[info] batch/grads                  ours 5.000e-02 theirs 1.000e-02 bound 1.891e-02 "
      "(2.64 of it) b\n");
  ASSERT_NE(group, std::string::npos) << out;
  ASSERT_NE(a, std::string::npos) << out;
  ASSERT_NE(b, std::string::npos) << out;
  EXPECT_LT(group, a);
  EXPECT_LT(a, b);
  Report plain;
  EXPECT_FALSE(contains(printed(plain, judge), "[info]"));
}

TEST(CheckGoldenJudge, GroupFailsWhenOneTensorIsOverItsBound) {
  Report report;
  const std::string out = printed(report, [](Report& r) {
    r.judged("packed/grads", {judge_bf16("a", 0.010, 0.010), judge_bf16("b", 0.050, 0.010)}, "theirs", "rule");
  });
  EXPECT_EQ(report.failed(), 1);
  EXPECT_TRUE(contains(out, "[FAIL] packed/grads")) << out;
  EXPECT_TRUE(contains(out, "in b [2 tensor(s), 1 over their bound;")) << out;
}

TEST(CheckGoldenJudge, TheirLargeErrorInOneTensorDoesNotWidenAnother) {
  // A flip in transformers' own bf16 run: 0.38 on the router weight. Ours there is as large and passes; the
  // attention weight beside it keeps its own bound.
  Report report;
  const std::string out = printed(report, [](Report& r) {
    r.judged("batch/grads",
             {judge_bf16("model.layers.1.mlp.gate.weight", 0.38, 0.38),
              judge_bf16("model.layers.1.self_attn.q_proj.weight", 0.08, 0.015)},
             "theirs", "rule");
  });
  EXPECT_EQ(report.failed(), 1);
  EXPECT_TRUE(contains(out, "in model.layers.1.self_attn.q_proj.weight")) << out;
}

TEST(CheckGoldenJudge, EmptyGroupAndNanFail) {
  Report report;
  const std::string out = printed(report, [](Report& r) {
    r.judged("batch/logits", {}, "theirs", "rule");
    r.judged("batch/loss", {judge_bf16("loss", 1e-4, 1e-4), judge_bf16("x", NAN, 1e-4)}, "theirs", "rule");
  });
  EXPECT_EQ(report.failed(), 2);
  EXPECT_TRUE(contains(out, "in x [2 tensor(s), 1 over their bound")) << out;
}

TEST(CheckGoldenJudge, Fp32GroupLineIsUnchanged) {
  Report report;
  const std::string out = printed(report, [](Report& r) {
    r.group("batch/grads", {{"a", 2e-6}, {"b", 1e-6}}, 1e-4);
    r.group("batch/logits", {{"logits", 2e-5}}, 1e-5);
  });
  EXPECT_EQ(out,
            "[ ok ] batch/grads                  worst rel err 2.000e-06 (threshold 1e-04) in a [2 tensor(s)]\n"
            "[FAIL] batch/logits                 worst rel err 2.000e-05 (threshold 1e-05) in logits [1 tensor(s)]\n");
  EXPECT_EQ(report.passed(), 1);
  EXPECT_EQ(report.failed(), 1);
}

// A small dump: an fp32 reference and transformers' bf16 one for two tensors and a loss.
std::string write_dump(bool with_bf16ref_grad) {
  const std::string dir = testing::make_temp_dir("judge");
  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.emplace_back("logits", Tensor::from_vector<float>({0.f, 0.f, 0.f, 0.f, 1.f, 2.f, 3.f, 4.f}, {1, 2, 4}));
  tensors.emplace_back("bf16ref.logits",
                       Tensor::from_vector<float>({0.f, 0.f, 0.f, 0.f, 1.f, 2.f, 3.f, 4.25f}, {1, 2, 4}));
  tensors.emplace_back("targets", Tensor::from_vector<int32_t>({2, 3}, {1, 2}));
  tensors.emplace_back("grad.w", Tensor::from_vector<float>({3.f, 4.f}, {2}));
  if (with_bf16ref_grad) tensors.emplace_back("bf16ref.grad.w", Tensor::from_vector<float>({3.f, 4.5f}, {2}));
  // loss = mean CE of the fp32 logits over both targets
  const double ce0 = std::log(4.0);
  const double ce1 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(4.0)) - 4.0;
  tensors.emplace_back("loss", Tensor::from_vector<float>({static_cast<float>((ce0 + ce1) / 2)}, {1}));
  io::write_safetensors(dir + "/reference.safetensors", tensors);
  return dir + "/reference.safetensors";
}

// The rounding ensemble's statistics: the mean of the members against the reference, and the spread
// sqrt(sum of unbiased per-element variances), both relative to ||ref||.
TEST(CheckGoldenJudge, EnsembleCenterAndSpreadOfKnownMembers) {
  EnsembleStats stats;
  stats.add("q", Tensor::from_vector<double>({1.0, 2.0}, {2}));
  stats.add("q", Tensor::from_vector<float>({3.0f, 2.0f}, {2}));  // any float dtype
  stats.add("q", Tensor::from_vector<double>({2.0, 5.0}, {2}));
  EXPECT_EQ(stats.members("q"), 3);
  EXPECT_EQ(stats.members("other"), 0);
  // mean (2, 3); variances (1, 3); reference (2, 0): ||mean - ref|| = 3, ||ref|| = 2.
  const auto [center, spread] = stats.center_and_spread("q", Tensor::from_vector<double>({2.0, 0.0}, {2}));
  EXPECT_DOUBLE_EQ(center, 1.5);
  EXPECT_DOUBLE_EQ(spread, std::sqrt(4.0) / 2.0);
}

TEST(CheckGoldenJudge, EnsembleRefusesMismatchedSizesAndTooFewMembers) {
  EnsembleStats stats;
  stats.add("q", Tensor::from_vector<double>({1.0, 2.0}, {2}));
  try {
    stats.center_and_spread("q", Tensor::from_vector<double>({1.0, 2.0}, {2}));
    ADD_FAILURE() << "a spread from one member was given";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "1 member(s) of 'q', expected at least 2")) << e.what();
  }
  try {
    stats.add("q", Tensor::from_vector<double>({1.0, 2.0, 3.0}, {3}));
    ADD_FAILURE() << "a member of another size was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "has 3 elements, the first had 2")) << e.what();
  }
  stats.add("q", Tensor::from_vector<double>({1.0, 2.0}, {2}));
  EXPECT_THROW(stats.center_and_spread("q", Tensor::from_vector<double>({1.0}, {1})), Error);
  EXPECT_THROW(stats.center_and_spread("missing", Tensor::from_vector<double>({1.0}, {1})), Error);
}

TEST(CheckGoldenJudge, TheirsIsBf16RefAgainstTheFp32Reference) {
  const io::SafetensorsReader ref = io::SafetensorsReader::open(write_dump(true));
  EXPECT_NEAR(theirs_error(ref, "grad.w"), 0.5 / 5.0, 1e-12);
  EXPECT_NEAR(theirs_error_over(ref, {"grad.w", "logits"}), std::sqrt(0.25 + 0.0625) / std::sqrt(25.0 + 30.0), 1e-7);
  // The loss yardstick: CE of bf16ref.logits against the reference loss.
  const double ce0 = std::log(4.0);
  const double theirs1 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(4.25)) - 4.25;
  const double ours1 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(4.0)) - 4.0;
  const double loss = static_cast<float>((ce0 + ours1) / 2);
  EXPECT_NEAR(theirs_loss_error(ref, ""), std::abs((ce0 + theirs1) / 2 - loss) / loss, 1e-9);
}

TEST(CheckGoldenJudge, MissingBf16RefTensorIsAnErrorNamingIt) {
  const io::SafetensorsReader ref = io::SafetensorsReader::open(write_dump(false));
  try {
    theirs_error(ref, "grad.w");
    ADD_FAILURE() << "a dump without bf16ref.grad.w was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "has no 'bf16ref.grad.w'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "make_golden.py")) << e.what();
  }
  EXPECT_THROW(theirs_error_over(ref, {"logits", "grad.w"}), Error);
  EXPECT_THROW(theirs_loss_error(ref, "packed."), Error);  // no bf16ref.packed.logits
}

TEST(CheckGoldenJudge, MeanCrossEntropySkipsIgnoredTargets) {
  const Tensor logits = Tensor::from_vector<float>({0.f, 0.f, 0.f, 0.f, 9.f, 0.f, 0.f, 0.f}, {2, 4});
  EXPECT_NEAR(mean_cross_entropy(logits, Tensor::from_vector<int32_t>({1, -100}, {2})), std::log(4.0), 1e-12);
  EXPECT_THROW(mean_cross_entropy(logits, Tensor::from_vector<int32_t>({-100, -100}, {2})), Error);
  EXPECT_THROW(mean_cross_entropy(logits, Tensor::from_vector<int32_t>({4, 0}, {2})), Error);
}

// Router logits of `tokens` tokens over 4 experts, top-2, margins of 1 ([3, 2, 1, 0] rotated), and ours: the
// reference plus rounding-like noise of 1e-3 (sigma = 1.48e-3). Edits make the flips of each test.
struct Router {
  std::vector<float> ref, ours;
  explicit Router(int tokens) {
    for (int t = 0; t < tokens; ++t) {
      for (int e = 0; e < 4; ++e) {
        ref.push_back(static_cast<float>((e + t) % 4));
        ours.push_back(ref.back() + 1e-3f * static_cast<float>((t * 4 + e) % 3 - 1));
      }
    }
  }
  void set(std::vector<float>& v, int t, std::vector<float> row) {
    std::copy(row.begin(), row.end(), v.begin() + 4 * t);
  }
  Tensor reference() const { return Tensor::from_vector(ref, {static_cast<int64_t>(ref.size() / 4), 4}); }
  Tensor our() const { return Tensor::from_vector(ours, {static_cast<int64_t>(ours.size() / 4), 4}); }
};

Tensor one_sequence(int64_t tokens) { return Tensor::from_vector<int32_t>({0, static_cast<int32_t>(tokens)}, {2}); }

TEST(CheckGoldenJudge, RobustSigmaIgnoresAFewLargeErrors) {
  Router r(20);
  EXPECT_NEAR(robust_sigma(r.our(), r.reference()), 1.4826e-3, 1e-6);
  r.ours[7 * 4 + 1] += 0.6f;  // one element off by far more
  EXPECT_NEAR(robust_sigma(r.our(), r.reference()), 1.4826e-3, 1e-6);
  EXPECT_TRUE(flip_is_near_tie(1e-3, 1.4826e-3));
  EXPECT_FALSE(flip_is_near_tie(0.5, 1.4826e-3));
}

TEST(CheckGoldenJudge, Bf16ExplainsANearTieFlipWithinRounding) {
  // Token 5: the reference's experts 1 and 2 a margin of 1e-3 apart, swapped in ours.
  Router r(20);
  r.set(r.ref, 5, {3.f, 1.001f, 1.f, 0.f});
  r.set(r.ours, 5, {3.f, 0.9995f, 1.0005f, 0.f});
  RoutingCheck bf16;
  bf16.explain_near_ties = true;
  bf16.add_pass({r.reference()}, {r.our()}, 2, one_sequence(20), "step 0 mb 1 ");
  EXPECT_TRUE(bf16.ok()) << bf16.summary();
  EXPECT_EQ(bf16.flips, 1);
  EXPECT_EQ(bf16.choices, 20);
  EXPECT_EQ(bf16.near_tie_layers, std::set<size_t>{0});
  EXPECT_TRUE(contains(bf16.summary(), "step 0 mb 1 MoE layer 0 token 5: reference margin 1.00e-03 (near-tie"))
      << bf16.summary();
  RoutingCheck f32;  // fp32: any flip fails
  f32.add_pass({r.reference()}, {r.our()}, 2, one_sequence(20));
  EXPECT_FALSE(f32.ok());
  EXPECT_TRUE(f32.near_tie_layers.empty());
}

// Token 7's second and third experts trade places at a margin (0.05) far beyond the layer's sigma (1.5e-3); one
// rounding of the weights moves that token's logits by `move` from ours (fp32) or from the reference's (bf16). Returns
// the check after that one flip.
RoutingCheck flip_after_a_move(float move, bool bf16) {
  Router r(20);
  r.set(r.ref, 7, {3.0f, 2.0f, 1.95f, 0.0f});
  r.set(r.ours, 7, {3.0f, 1.95f, 2.0f, 0.0f});
  std::vector<float> rounded = bf16 ? r.ref : r.ours;
  rounded[7 * 4 + 1] += move;
  const std::vector<std::vector<Tensor>> after{{Tensor::from_vector(rounded, {20, 4})}};
  RoutingCheck check;
  check.explain_near_ties = true;
  check.after_rounding = &after;
  check.moved_from_reference = bf16;
  check.rounding = bf16 ? "bf16" : "fp32";
  check.add_pass({r.reference()}, {r.our()}, 2, one_sequence(20));
  check.after_rounding = nullptr;  // `after` ends here
  return check;
}

// fp32: a move of 0.01 puts the margin within 5 x sqrt(2) of it, a near tie; a move of 1e-3 does not.
// bf16: the same, the move measured from the reference's logits, where one bf16 rounding of the f32 path's weights
// starts (our bf16 logits are off by at least half the margin at every flip): with a move of 1e-3 the rounded logits
// are still 0.05 from ours, and the flip is not explained.
TEST(CheckGoldenJudge, ExplainsAFlipWithinHowFarOneRoundingMovesTheToken) {
  for (const bool bf16 : {false, true}) {
    for (const auto& [move, explained] : {std::pair<float, bool>{0.01f, true}, {1e-3f, false}}) {
      const RoutingCheck check = flip_after_a_move(move, bf16);
      EXPECT_EQ(check.flips, 1);
      EXPECT_EQ(check.ok(), explained) << bf16 << " " << check.summary();
      if (explained) {
        const std::string how = bf16 ? "how far one bf16 rounding of every weight moves"
                                     : "how far one fp32 rounding of every weight moves";
        EXPECT_TRUE(contains(check.summary(), how)) << check.summary();
      }
    }
  }
}

TEST(CheckGoldenJudge, TakesTheLargestMoveOverTheEnsemblesMembers) {
  // Token 7's flip at a margin of 0.05: the first member moves it 1e-3 (not a near tie, as above), the second 0.01.
  // One member is one draw of a heavy-tailed move; the largest over the members judges the flip.
  Router r(20);
  r.set(r.ref, 7, {3.0f, 2.0f, 1.95f, 0.0f});
  r.set(r.ours, 7, {3.0f, 1.95f, 2.0f, 0.0f});
  std::vector<std::vector<Tensor>> members;
  for (const float move : {1e-3f, 0.01f}) {
    std::vector<float> rounded = r.ref;
    rounded[7 * 4 + 1] += move;
    members.push_back({Tensor::from_vector(rounded, {20, 4})});
  }
  for (const size_t count : {size_t{1}, size_t{2}}) {
    const std::vector<std::vector<Tensor>> used(members.begin(), members.begin() + static_cast<std::ptrdiff_t>(count));
    RoutingCheck check;
    check.explain_near_ties = true;
    check.after_rounding = &used;
    check.moved_from_reference = true;
    check.rounding = "bf16";
    check.add_pass({r.reference()}, {r.our()}, 2, one_sequence(20));
    EXPECT_EQ(check.flips, 1);
    EXPECT_EQ(check.ok(), count == 2) << check.summary();
    const std::string how = count == 2 ? "x 1.00e-02, how far one bf16 rounding of every weight moves this token's "
                                         "router logits, the largest of 2)"
                                       : "one bf16 rounding of every weight moves it 1.00e-03, the largest of 1;";
    EXPECT_TRUE(contains(check.summary(), how)) << check.summary();
  }
}

TEST(CheckGoldenJudge, Bf16FailsAFlipThatRoundingCannotMake) {
  // Token 7 is [3, 0, 1, 2]: expert 2 (third) lifted by 1.6 over expert 3 (second), a margin of 1. Our error at
  // the swapped experts covers the margin (as every flip's does), but the layer's rounding (sigma 1.5e-3) is far
  // from it.
  Router r(20);
  r.ours[7 * 4 + 2] += 1.6f;
  RoutingCheck bf16;
  bf16.explain_near_ties = true;
  bf16.add_pass({r.reference()}, {r.our()}, 2, one_sequence(20));
  EXPECT_EQ(bf16.flips, 1);
  EXPECT_EQ(bf16.unexplained, 1);
  EXPECT_FALSE(bf16.ok());
  EXPECT_TRUE(bf16.near_tie_layers.empty());
}

TEST(CheckGoldenJudge, Bf16ExplainsFlipsDownstreamOfANearTieInItsSequenceOnly) {
  // Two sequences of 10 tokens. MoE layer 0: a near-tie flip at token 3. MoE layer 1: large-margin flips at token
  // 6 (after token 3, same sequence: its consequence), token 2 (before it) and token 12 (the other sequence).
  Router first(20), second(20);
  first.set(first.ref, 3, {3.f, 1.001f, 1.f, 0.f});
  first.set(first.ours, 3, {3.f, 0.9995f, 1.0005f, 0.f});
  // In layer 1 row t is [3, 2, 1, 0] rotated by t; lift the third-ranked expert over the second.
  for (int t : {6, 2, 12}) {
    for (int e = 0; e < 4; ++e) {
      if ((e + t) % 4 == 1) second.ours[static_cast<size_t>(t * 4 + e)] += 1.6f;
    }
  }
  RoutingCheck bf16;
  bf16.explain_near_ties = true;
  bf16.add_pass({first.reference(), second.reference()}, {first.our(), second.our()}, 2,
                Tensor::from_vector<int32_t>({0, 10, 20}, {3}));
  EXPECT_EQ(bf16.flips, 4);
  EXPECT_EQ(bf16.unexplained, 2);  // tokens 2 and 12
  EXPECT_EQ(bf16.near_tie_layers, (std::set<size_t>{0, 1}));
  // The unexplained flips are named first, with what was measured at the token.
  EXPECT_TRUE(contains(bf16.summary(),
                       "2 not explained by rounding; MoE layer 1 token 2: reference margin 1.00e+00 "
                       "(not a near-tie: sigma 1.48e-03; ours is off the reference by 1.60e+00); "
                       "MoE layer 1 token 12:"))
      << bf16.summary();
  EXPECT_TRUE(contains(bf16.summary(), "MoE layer 1 token 6: reference margin 1.00e+00 (after a near-tie flip"))
      << bf16.summary();
}

TEST(CheckGoldenJudge, OnlyTensorsThePinnedPassHoldsWithinBoundAreExcused) {
  const std::vector<Judged> free{judge_bf16("over.pinned_within", 0.3, 0.01), judge_bf16("within", 0.01, 0.01),
                                 judge_bf16("over.pinned_over", 0.3, 0.01), judge_bf16("over.not_pinned", 0.3, 0.01)};
  const std::vector<Judged> pinned{judge_bf16("over.pinned_within", 0.012, 0.01),
                                   judge_bf16("over.pinned_over", 0.2, 0.01), judge_bf16("within", 0.01, 0.01)};
  const Excusal e = excuse_by_pinned_pass(free, pinned, true);
  ASSERT_EQ(e.excused.size(), 1u);
  EXPECT_EQ(e.excused[0].name, "over.pinned_within");
  ASSERT_EQ(e.kept.size(), 3u);  // within its bound, over it in the pinned pass too, or absent from it: still judged
  EXPECT_TRUE(contains(excused_line("batch/excused", e), "over.pinned_within 3.00e-01")) << excused_line("b", e);
  // A flip that rounding does not explain excuses nothing.
  const Excusal unexplained = excuse_by_pinned_pass(free, pinned, false);
  EXPECT_TRUE(unexplained.excused.empty());
  EXPECT_EQ(unexplained.kept.size(), 4u);
  EXPECT_EQ(excused_line("batch/excused", unexplained), "");
}

}  // namespace
}  // namespace moetrain::cli::golden
