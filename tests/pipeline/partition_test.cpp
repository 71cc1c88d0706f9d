// Tests for pipeline/partition: the balanced cut of the tiny MoE example for P = 1, 2, 4, the head's weight on the
// last stage, optimality against brute force on uneven layers, explicit cuts, and the refusals.
#include "pipeline/partition.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/families/qwen3_moe/config.h"
#include "model/model_config.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

using testing::expect_error;

const std::string kTinyMoe = testing::repo_path("examples/tiny_moe/config.json");

model::ModelConfig tiny_moe() { return model::load_model_config(kTinyMoe); }

// The tiny example's config.json with some fields changed.
model::ModelConfig tiny_moe_with(const nlohmann::json& changes) {
  std::ifstream in(kTinyMoe);
  nlohmann::json config = nlohmann::json::parse(in);
  config.update(changes);
  return model::parse_model_config(config.dump(), "changed tiny_moe/config.json");
}

std::vector<int64_t> stage_sizes(const Partition& p) {
  std::vector<int64_t> sizes;
  for (const StageLayers& s : p.stages) sizes.push_back(s.num_layers());
  return sizes;
}

// The layout every partition must have: 2P contiguous stages covering all layers, the V's ranks, the embedding on
// stage 0, final norm and head on the last stage.
void expect_well_formed(const Partition& p, int pp, int64_t num_layers) {
  ASSERT_EQ(p.pp, pp);
  ASSERT_EQ(p.stages.size(), static_cast<size_t>(2 * pp));
  int64_t next = 0;
  for (int s = 0; s < 2 * pp; ++s) {
    const StageLayers& st = p.stages[static_cast<size_t>(s)];
    EXPECT_EQ(st.stage, s);
    EXPECT_EQ(st.rank, s < pp ? s : 2 * pp - 1 - s) << "stage " << s;
    EXPECT_EQ(st.first_layer, next) << "stage " << s;
    EXPECT_GE(st.num_layers(), 1) << "stage " << s;
    EXPECT_EQ(st.has_embedding, s == 0) << "stage " << s;
    EXPECT_EQ(st.has_final_norm, s == 2 * pp - 1) << "stage " << s;
    EXPECT_EQ(st.has_head, s == 2 * pp - 1) << "stage " << s;
    next = st.end_layer;
  }
  EXPECT_EQ(next, num_layers);
  for (int r = 0; r < pp; ++r) {
    EXPECT_EQ(p.down_stage(r).stage, r);
    EXPECT_EQ(p.up_stage(r).stage, 2 * pp - 1 - r);
    EXPECT_EQ(p.down_stage(r).rank, r);
    EXPECT_EQ(p.up_stage(r).rank, r);
  }
}

// Forward + backward FLOPs per token, written out independently: 6 x (q, k, v, o projections + router + top-k
// experts, or the dense MLP) + 3 x the causal attention core at S = 4096; the head 6 x H x V on the last stage.
double layer_flops(const model::ModelConfig& c, int64_t layer) {
  const auto& f = c.family_config<model::families::qwen3_moe::Qwen3MoeConfig>();
  const double H = double(c.hidden_size);
  const double q = double(f.num_attention_heads * f.head_dim), kv = double(f.num_key_value_heads * f.head_dim);
  double weights = H * q + 2 * H * kv + q * H;
  const bool moe = c.num_experts > 0 &&
                   std::find(f.mlp_only_layers.begin(), f.mlp_only_layers.end(), layer) == f.mlp_only_layers.end();
  weights += moe ? H * double(c.num_experts) + double(c.num_experts_per_tok) * 3 * H * double(f.moe_intermediate_size)
                 : 3 * H * double(f.intermediate_size);
  return 6 * weights + 3 * 4 * 2048.0 * q;
}

double max_stage_flops(const model::ModelConfig& c, const std::vector<int64_t>& bounds) {
  double worst = 0.0;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    double cost = 0.0;
    for (int64_t l = bounds[s]; l < bounds[s + 1]; ++l) cost += layer_flops(c, l);
    if (s + 2 == bounds.size()) cost += 6 * double(c.hidden_size) * double(c.vocab_size);
    worst = std::max(worst, cost);
  }
  return worst;
}

// The smallest max stage cost over every way to cut the layers into `num_stages` non-empty contiguous stages.
double brute_force_best(const model::ModelConfig& c, int num_stages) {
  double best = 1e300;
  std::vector<int64_t> bounds = {0};
  std::function<void(int)> place = [&](int stage) {
    if (stage == num_stages - 1) {
      bounds.push_back(c.num_hidden_layers);
      best = std::min(best, max_stage_flops(c, bounds));
      bounds.pop_back();
      return;
    }
    for (int64_t end = bounds.back() + 1; end <= c.num_hidden_layers - (num_stages - 1 - stage); ++end) {
      bounds.push_back(end);
      place(stage + 1);
      bounds.pop_back();
    }
  };
  place(0);
  return best;
}

std::vector<int64_t> bounds_of(const Partition& p) {
  std::vector<int64_t> b = {0};
  for (const StageLayers& s : p.stages) b.push_back(s.end_layer);
  return b;
}

TEST(Partition, BalancedSplitsTheTinyModelsEightLayersEvenly) {
  const model::ModelConfig c = tiny_moe();
  ASSERT_EQ(c.num_hidden_layers, 8);
  const std::vector<std::pair<int, std::vector<int64_t>>> expected = {
      {1, {4, 4}}, {2, {2, 2, 2, 2}}, {4, {1, 1, 1, 1, 1, 1, 1, 1}}};
  for (const auto& [pp, sizes] : expected) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    const Partition p = partition_balanced(c, pp);
    expect_well_formed(p, pp, 8);
    EXPECT_EQ(stage_sizes(p), sizes);
  }
}

TEST(Partition, BalancedCountsTheHeadOnTheLastStage) {
  model::ModelConfig c = tiny_moe();
  // A vocabulary whose head costs exactly two layers: the last stage gives up two layers' worth.
  c.vocab_size = static_cast<int64_t>(2 * layer_flops(c, 0) / (6.0 * double(c.hidden_size)));
  ASSERT_EQ(6 * double(c.hidden_size) * double(c.vocab_size), 2 * layer_flops(c, 0));
  const Partition p = partition_balanced(c, 1);
  expect_well_formed(p, 1, 8);
  EXPECT_EQ(stage_sizes(p), (std::vector<int64_t>{5, 3}));
}

TEST(Partition, BalancedMinimisesTheLargestStageOnUnevenLayers) {
  // Dense layers cost several MoE layers: heavy at the front and one near the end.
  const model::ModelConfig c =
      tiny_moe_with({{"num_hidden_layers", 12}, {"intermediate_size", 4096}, {"mlp_only_layers", {0, 1, 2, 9}}});
  for (int pp : {1, 2, 3}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    const Partition p = partition_balanced(c, pp);
    expect_well_formed(p, pp, 12);
    EXPECT_EQ(max_stage_flops(c, bounds_of(p)), brute_force_best(c, 2 * pp));
  }
  // Two heavy layers together exceed the optimum, so with six stages layers 0 and 1 each get a stage of their own.
  const Partition p3 = partition_balanced(c, 3);
  EXPECT_EQ(p3.stages[0].num_layers(), 1);
  EXPECT_EQ(p3.stages[1].num_layers(), 1);
}

TEST(Partition, BalancedNeedsAtLeastOneLayerPerStage) {
  const model::ModelConfig c = tiny_moe();
  expect_well_formed(partition_balanced(c, 4), 4, 8);  // exactly one layer each is fine
  expect_error([&] { partition_balanced(c, 5); }, {"pp = 5 needs 10 stages", "the model has 8 layers", "at most 4"});
  expect_error([&] { partition_balanced(c, 0); }, {"parallel.pp must be >= 1, found 0"});
}

TEST(Partition, FromCutsPutsEachStageBetweenItsCuts) {
  const model::ModelConfig c = tiny_moe();
  const Partition p = partition_from_cuts(c, 2, {1, 3, 6});
  expect_well_formed(p, 2, 8);
  EXPECT_EQ(stage_sizes(p), (std::vector<int64_t>{1, 2, 3, 2}));
  EXPECT_EQ(p.stages[2].first_layer, 3);
  EXPECT_EQ(p.stages[2].end_layer, 6);
  EXPECT_EQ(p.up_stage(0).first_layer, 6);  // rank 0 holds layers 0 and 6..7
  const Partition one = partition_from_cuts(c, 1, {7});
  expect_well_formed(one, 1, 8);
  EXPECT_EQ(stage_sizes(one), (std::vector<int64_t>{7, 1}));
}

TEST(Partition, FromCutsRejectsWrongCountOutOfRangeAndNonIncreasingCuts) {
  const model::ModelConfig c = tiny_moe();
  expect_error([&] { partition_from_cuts(c, 2, {2, 4}); }, {"needs 3 cut points, found 2"});
  expect_error([&] { partition_from_cuts(c, 2, {0, 3, 6}); }, {"pp_cuts[0] = 0", "outside (0, 8)"});
  expect_error([&] { partition_from_cuts(c, 2, {2, 4, 8}); }, {"pp_cuts[2] = 8", "outside (0, 8)"});
  expect_error([&] { partition_from_cuts(c, 2, {3, 3, 6}); }, {"pp_cuts[1] = 3 is not greater than pp_cuts[0] = 3"});
  expect_error([&] { partition_from_cuts(c, 2, {4, 2, 6}); }, {"pp_cuts[1] = 2 is not greater than pp_cuts[0] = 4"});
  expect_error([&] { partition_from_cuts(c, 5, {1, 2, 3, 4, 5, 6, 7, 8, 9}); }, {"needs 10 stages", "8 layers"});
}

}  // namespace
}  // namespace moetrain::pipeline
