// Tests for ops/permute: the routing plan (hand case with an idle expert), permute -> unpermute against the direct
// weighted sum, backward of both against finite differences, per-token independence, argument checks, and the _add
// forms (an addend joined in the same pass) against the op followed by accumulate, bit for bit; concat_permuted_rows
// (several micro-batches' rows made from their tokens in concat_group_rows' layout) on a hand case and against the ops
// it fuses, bit for bit, and its refusals.
#include "ops/permute.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/elementwise.h"
#include "ops/row_gather.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;

using testing::random_tensor;
using testing::relative_error;

Tensor random_choices(int64_t tokens, int64_t top_k, int64_t experts, Rng& rng) {
  std::vector<int32_t> index(static_cast<size_t>(tokens * top_k));
  for (int32_t& e : index) e = static_cast<int32_t>(rng.below(static_cast<uint64_t>(experts)));
  return Tensor::from_vector<int32_t>(index, {tokens, top_k});
}

Tensor permute(const Tensor& x, const ops::RoutingPlan& plan) {
  Tensor permuted = Tensor::empty({plan.num_tokens * plan.top_k, x.size(1)}, x.dtype());
  ops::permute_forward(Stream::cpu(), permuted, x, plan);
  return permuted;
}

Tensor unpermute(const Tensor& expert_out, const Tensor& weight, const ops::RoutingPlan& plan) {
  Tensor y = Tensor::empty({plan.num_tokens, expert_out.size(1)}, expert_out.dtype());
  ops::unpermute_forward(Stream::cpu(), y, expert_out, weight, plan);
  return y;
}

TEST(RoutingPlan, HandCaseGroupsChoicesStablyByExpertWithAnIdleExpert) {
  // Choices (t, k) -> expert: (0,0) 2, (0,1) 0, (1,0) 2, (1,1) 3, (2,0) 0, (2,1) 2; expert 1 gets none.
  const Tensor index = Tensor::from_vector<int32_t>({2, 0, 2, 3, 0, 2}, {3, 2});
  const ops::RoutingPlan plan = ops::make_routing_plan(Stream::cpu(), index, 4);
  EXPECT_EQ(plan.num_tokens, 3);
  EXPECT_EQ(plan.top_k, 2);
  EXPECT_EQ(plan.num_experts, 4);
  EXPECT_EQ(plan.expert_offsets.to_vector<int32_t>(), (std::vector<int32_t>{0, 2, 2, 5, 6}));
  EXPECT_EQ(plan.row_choice.to_vector<int32_t>(), (std::vector<int32_t>{1, 4, 0, 2, 5, 3}));
  EXPECT_EQ(plan.choice_row.to_vector<int32_t>(), (std::vector<int32_t>{2, 0, 3, 5, 1, 4}));
}

TEST(RoutingPlan, RejectsExpertIndexOutOfRange) {
  expect_error(
      [] {
        ops::make_routing_plan(Stream::cpu(), Tensor::from_vector<int32_t>({0, 1, 4, 2}, {2, 2}), 4);
      },
      "make_routing_plan: topk_index[token 1, slot 0] = 4 is outside [0, E = 4)");
  expect_error(
      [] {
        ops::make_routing_plan(Stream::cpu(), Tensor::from_vector<int32_t>({0, -1}, {1, 2}), 4);
      },
      "topk_index[token 0, slot 1] = -1 is outside [0, E = 4)");
  expect_error(
      [] {
        ops::make_routing_plan(Stream::cpu(), Tensor::zeros({2, 2}, DType::I64), 4);
      },
      "make_routing_plan: topk_index: expected dtype i32 but found i64");
  expect_error(
      [] {
        ops::make_routing_plan(Stream::cpu(), Tensor::zeros({2, 2}, DType::I32), 0);
      },
      "num_experts must be in [1, 2^31 - 1) but found 0");
}

TEST(Permute, PermuteThenUnpermuteWithIdentityExpertsIsTheWeightedSum) {
  const int64_t tokens = 11, top_k = 3, experts = 5, hidden = 7;
  Rng rng(1);
  const Tensor index = random_choices(tokens, top_k, experts, rng);
  const Tensor x = random_tensor({tokens, hidden}, DType::F32, rng);
  const Tensor weight = random_tensor({tokens, top_k}, DType::F32, rng);
  const ops::RoutingPlan plan = ops::make_routing_plan(Stream::cpu(), index, experts);

  const Tensor permuted = permute(x, plan);
  const int32_t* offsets = plan.expert_offsets.data<int32_t>();
  const int32_t* row_choice = plan.row_choice.data<int32_t>();
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int64_t c = row_choice[r];
      EXPECT_EQ(index.data<int32_t>()[c], e) << "row " << r << " sits in expert " << e << "'s range";
      EXPECT_EQ(permuted.select(r).to_vector<float>(), x.select(c / top_k).to_vector<float>()) << "row " << r;
    }
  }

  const Tensor y = unpermute(permuted, weight, plan);
  Tensor expected = Tensor::zeros({tokens, hidden}, DType::F64);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      for (int64_t h = 0; h < hidden; ++h) {
        expected.data<double>()[t * hidden + h] +=
            static_cast<double>(weight.data<float>()[t * top_k + k]) * x.data<float>()[t * hidden + h];
      }
    }
  }
  EXPECT_LT(relative_error(y, expected), 1e-6);
}

TEST(Permute, TokenRowsDoNotDependOnOtherTokens) {
  const int64_t top_k = 2, experts = 4, hidden = 5;
  Rng rng(2);
  const Tensor index = random_choices(9, top_k, experts, rng);
  const Tensor x = random_tensor({9, hidden}, DType::F32, rng);
  const Tensor weight = random_tensor({9, top_k}, DType::F32, rng);
  // Expert "outputs" that depend on the choice only: the permuted input scaled by (1 + expert index).
  const auto run = [&](int64_t tokens) {
    const Tensor idx = index.slice(0, tokens).clone();
    const ops::RoutingPlan plan = ops::make_routing_plan(Stream::cpu(), idx, experts);
    Tensor out = permute(x.slice(0, tokens).clone(), plan);
    for (int64_t r = 0; r < out.size(0); ++r) {
      const float scale = 1.0f + static_cast<float>(idx.data<int32_t>()[plan.row_choice.data<int32_t>()[r]]);
      for (int64_t h = 0; h < hidden; ++h) out.data<float>()[r * hidden + h] *= scale;
    }
    return unpermute(out, weight.slice(0, tokens).clone(), plan);
  };
  const Tensor all = run(9), part = run(4);
  EXPECT_EQ(all.slice(0, 4).clone().to_vector<float>(), part.to_vector<float>());
}

TEST(Permute, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 6, top_k = 2, experts = 3, hidden = 4;
  Rng rng(3);
  const ops::RoutingPlan plan =
      ops::make_routing_plan(Stream::cpu(), random_choices(tokens, top_k, experts, rng), experts);
  Tensor x = random_tensor({tokens, hidden}, DType::F64, rng);
  const Tensor r = random_tensor({tokens * top_k, hidden}, DType::F64, rng);
  Tensor dx = Tensor::empty({tokens, hidden}, DType::F64);
  ops::permute_backward(Stream::cpu(), dx, r, plan);
  testing::expect_gradients_match([&] { return testing::dot(permute(x, plan), r); }, {{"x", x, dx}});
}

TEST(Unpermute, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 6, top_k = 3, experts = 4, hidden = 4;
  Rng rng(4);
  const ops::RoutingPlan plan =
      ops::make_routing_plan(Stream::cpu(), random_choices(tokens, top_k, experts, rng), experts);
  Tensor expert_out = random_tensor({tokens * top_k, hidden}, DType::F64, rng);
  Tensor weight = random_tensor({tokens, top_k}, DType::F64, rng);
  const Tensor r = random_tensor({tokens, hidden}, DType::F64, rng);
  Tensor dexpert_out = Tensor::empty(expert_out.shape(), DType::F64),
         dweight = Tensor::empty(weight.shape(), DType::F64);
  ops::unpermute_backward(Stream::cpu(), dexpert_out, dweight, r, expert_out, weight, plan);
  testing::expect_gradients_match([&] { return testing::dot(unpermute(expert_out, weight, plan), r); },
                                  {{"expert_out", expert_out, dexpert_out}, {"topk_weight", weight, dweight}});
}

TEST(Permute, RejectsMismatchedShapesAndBrokenPlans) {
  Stream& s = Stream::cpu();
  Rng rng(5);
  const ops::RoutingPlan plan = ops::make_routing_plan(s, random_choices(4, 2, 3, rng), 3);
  const Tensor x = random_tensor({4, 6}, DType::F32, rng);
  Tensor permuted = Tensor::empty({8, 6}, DType::F32);
  expect_error([&] { ops::permute_forward(s, permuted, x.slice(0, 3), plan); },
               "permute_forward: x: expected shape [4, 6] but found [3, 6]");
  expect_error(
      [&] {
        ops::permute_forward(s, Tensor::empty({8, 5}, DType::F32), x, plan);
      },
      "permute_forward: permuted: expected shape [8, 6] but found [8, 5]");
  expect_error(
      [&] {
        ops::permute_backward(s, Tensor::empty({4, 6}, DType::F64), permuted, plan);
      },
      "permute_backward: dx: expected dtype f32 but found f64");
  Tensor y = Tensor::empty({4, 6}, DType::F32);
  expect_error(
      [&] {
        ops::unpermute_forward(s, y, permuted, Tensor::empty({4, 3}, DType::F32), plan);
      },
      "unpermute_forward: topk_weight: expected shape [4, 2] but found [4, 3]");
  const Tensor weight = random_tensor({4, 2}, DType::F32, rng);
  Tensor dweight = Tensor::empty({4, 2}, DType::F32);
  expect_error(
      [&] {
        ops::unpermute_backward(s, Tensor::empty({7, 6}, DType::F32), dweight, y, permuted, weight, plan);
      },
      "unpermute_backward: dexpert_out: expected shape [8, 6] but found [7, 6]");

  ops::RoutingPlan broken = plan;
  broken.choice_row = plan.choice_row.clone();
  broken.choice_row.data<int32_t>()[1] = broken.choice_row.data<int32_t>()[0];
  expect_error([&] { ops::permute_forward(s, permuted, x, broken); }, "permute_forward: plan.choice_row[1] = ");
  broken.choice_row.data<int32_t>()[1] = 8;
  expect_error([&] { ops::unpermute_forward(s, y, permuted, weight, broken); }, "plan.choice_row[1] = 8");
}

TEST(PermuteAdd, GivesTheBitsOfTheOpThenAccumulate) {
  Stream& s = Stream::cpu();
  Rng rng(91);
  const int64_t tokens = 9, top_k = 3, experts = 4, hidden = 20;
  const ops::RoutingPlan plan = ops::make_routing_plan(s, random_choices(tokens, top_k, experts, rng), experts);
  const Tensor rows = random_tensor({tokens * top_k, hidden}, DType::F32, rng);
  const Tensor weight = random_tensor({tokens, top_k}, DType::F32, rng);
  const Tensor addend = random_tensor({tokens, hidden}, DType::F32, rng);

  Tensor y = Tensor::empty({tokens, hidden}, DType::F32);
  ops::unpermute_forward_add(s, y, rows, weight, plan, addend);
  Tensor want_y = unpermute(rows, weight, plan);
  ops::accumulate(s, want_y, addend);
  EXPECT_TRUE(testing::same_bytes(y, want_y));

  Tensor dx = Tensor::empty({tokens, hidden}, DType::F32);
  ops::permute_backward_add(s, dx, rows, plan, addend);
  Tensor want_dx = Tensor::empty({tokens, hidden}, DType::F32);
  ops::permute_backward(s, want_dx, rows, plan);
  ops::accumulate(s, want_dx, addend);
  EXPECT_TRUE(testing::same_bytes(dx, want_dx));

  expect_error([&] { ops::permute_backward_add(s, dx, rows, plan, dx); }, "expected the addend");
  expect_error([&] { ops::unpermute_forward_add(s, y, rows, weight, plan, y.slice(0, 4)); },
               "unpermute_forward_add: addend");
  expect_error([&] { ops::permute_backward_add(s, dx, rows, plan, addend.to(DType::F64)); },
               "permute_backward_add: addend");
}

// Sources of concat_permuted_rows: the routing plan and the tokens (and weights) of each micro-batch.
struct Source {
  ops::RoutingPlan plan;
  Tensor tokens, weight;
};

std::vector<ops::PermutedRows> permuted_rows(const std::vector<Source>& sources, bool weighted) {
  std::vector<ops::PermutedRows> out;
  for (const Source& source : sources) out.push_back({source.tokens, weighted ? source.weight : Tensor(), source.plan});
  return out;
}

Tensor concat_permuted(const std::vector<ops::PermutedRows>& sources) {
  int64_t rows = 0;
  for (const ops::PermutedRows& source : sources) rows += source.plan.num_tokens * source.plan.top_k;
  Tensor out = Tensor::empty({rows, sources[0].tokens.size(1)}, sources[0].tokens.dtype());
  ops::concat_permuted_rows(Stream::cpu(), out, sources);
  return out;
}

TEST(ConcatPermutedRows, HandCaseLaysOutEachExpertsRowsSourceBySource) {
  Stream& s = Stream::cpu();
  // Source 0: the plan of RoutingPlan's hand case (expert 1 idle); source 1: choices (0,0) 1, (0,1) 0, (1,0) 3,
  // (1,1) 0 (expert 2 idle). One column: token t of source 0 holds 10 t, of source 1 100 + 10 t.
  const ops::RoutingPlan a = ops::make_routing_plan(s, Tensor::from_vector<int32_t>({2, 0, 2, 3, 0, 2}, {3, 2}), 4);
  const ops::RoutingPlan b = ops::make_routing_plan(s, Tensor::from_vector<int32_t>({1, 0, 3, 0}, {2, 2}), 4);
  const Tensor tokens_a = Tensor::from_vector<float>({0, 10, 20}, {3, 1});
  const Tensor tokens_b = Tensor::from_vector<float>({100, 110}, {2, 1});
  const Tensor out = concat_permuted({{tokens_a, Tensor(), a}, {tokens_b, Tensor(), b}});
  // Expert 0: a's tokens 0, 2 then b's 0, 1; expert 1: b's token 0; expert 2: a's tokens 0, 1, 2; expert 3: a's
  // token 1, then b's token 1.
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{0, 20, 100, 110, 100, 0, 10, 20, 10, 110}));
  // Weighted: each row times its choice's weight.
  const Tensor weight_a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  const Tensor weight_b = Tensor::from_vector<float>({0.5f, 0.25f, 2, 4}, {2, 2});
  const Tensor weighted = concat_permuted({{tokens_a, weight_a, a}, {tokens_b, weight_b, b}});
  EXPECT_EQ(weighted.to_vector<float>(), (std::vector<float>{0, 100, 25, 440, 50, 0, 30, 120, 40, 220}));
}

TEST(ConcatPermutedRows, GivesTheBitsOfTheOpsItFuses) {
  Stream& s = Stream::cpu();
  Rng rng(97);
  const int64_t experts = 6, top_k = 3, hidden = 13;
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<Source> sources;
    for (int64_t tokens : {7, 0, 12, 1}) {  // an empty micro-batch, and experts idle in some
      Source source;
      source.plan = ops::make_routing_plan(s, random_choices(tokens, top_k, experts, rng), experts);
      source.tokens = random_tensor({tokens, hidden}, dtype, rng);
      source.weight = random_tensor({tokens, top_k}, dtype, rng);
      sources.push_back(source);
    }
    std::vector<Tensor> permuted, dexpert_out, offsets;
    for (const Source& source : sources) {
      const int64_t rows = source.plan.num_tokens * top_k;
      permuted.push_back(permute(source.tokens, source.plan));
      // unpermute_backward's dexpert_out with the tokens as dy (its dtopk_weight is not compared).
      Tensor d_rows = Tensor::empty({rows, hidden}, dtype),
             d_weight = Tensor::empty({source.plan.num_tokens, top_k}, dtype);
      ops::unpermute_backward(s, d_rows, d_weight, source.tokens, permuted.back(), source.weight, source.plan);
      dexpert_out.push_back(d_rows);
      offsets.push_back(source.plan.expert_offsets);
    }
    const int64_t total = 20 * top_k;
    for (bool weighted : {false, true}) {
      Tensor want = Tensor::empty({total, hidden}, dtype);
      ops::concat_group_rows(s, want, weighted ? dexpert_out : permuted, offsets);
      EXPECT_TRUE(testing::same_bytes(concat_permuted(permuted_rows(sources, weighted)), want)) << weighted;
    }
  }
}

TEST(ConcatPermutedRows, RejectsSourcesItCannotLayOut) {
  Stream& s = Stream::cpu();
  Rng rng(98);
  const ops::RoutingPlan plan = ops::make_routing_plan(s, random_choices(4, 2, 3, rng), 3);
  const Tensor tokens = random_tensor({4, 6}, DType::F32, rng), weight = random_tensor({4, 2}, DType::F32, rng);
  Tensor out = Tensor::empty({16, 6}, DType::F32);
  const ops::PermutedRows plain{tokens, Tensor(), plan}, weighted{tokens, weight, plan};
  expect_error([&] { ops::concat_permuted_rows(s, out, {}); },
               "concat_permuted_rows: expected 1 to 64 sources but found 0");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {plain, weighted});
      },
      "concat_permuted_rows: the sources are all weighted or none; sources[0] is not but sources[1] is "
      "weighted");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out.slice(0, 15), {plain, plain});
      },
      "concat_permuted_rows: out: expected shape [16, 6] but found [15, 6]");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {plain, {tokens.slice(0, 3), Tensor(), plan}});
      },
      "concat_permuted_rows (sources[1]): tokens: expected shape [4, 6] but found [3, 6]");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {plain, {tokens.to(DType::F64), Tensor(), plan}});
      },
      "concat_permuted_rows (sources[1]): tokens: expected dtype f32 but found f64");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {weighted, {tokens, weight.slice(0, 3), plan}});
      },
      "concat_permuted_rows (sources[1]): weight: expected shape [4, 2] but found [3, 2]");
  const ops::RoutingPlan wider = ops::make_routing_plan(s, random_choices(4, 2, 5, rng), 5);
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {plain, {tokens, Tensor(), wider}});
      },
      "every source's plan groups its rows by the same experts; sources[0] has E = 3 but sources[1] has E = "
      "5");
  ops::RoutingPlan broken = plan;
  broken.choice_row = plan.choice_row.clone();
  broken.choice_row.data<int32_t>()[1] = broken.choice_row.data<int32_t>()[0];
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {plain, {tokens, Tensor(), broken}});
      },
      "concat_permuted_rows (sources[1]): plan.choice_row[1] = ");
  const std::vector<ops::PermutedRows> too_many(65, plain);
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, Tensor::empty({65 * 8, 6}, DType::F32), too_many);
      },
      "expected 1 to 64 sources but found 65");
}

}  // namespace
}  // namespace moetrain
