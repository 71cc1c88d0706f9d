// Tests for the DeepSeek-V2 family's config.json parsing (model/families/deepseek_v2): the golden config, its
// layers (dense first, then MoE), the JSON writer's round trip, YaRN, and a refusal for every value it does not run.
#include "model/families/deepseek_v2/config.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/causal_lm.h"
#include "model/family.h"
#include "model/model_config.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using families::deepseek_v2::DeepseekV2Config;
using nlohmann::json;

json golden_json() { return io::read_json_object(testing::test_data_path("golden/deepseek_v2/config.json")); }

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }
const DeepseekV2Config& ds(const ModelConfig& c) { return c.family_config<DeepseekV2Config>(); }

// Parses `j` expecting an Error whose message holds every one of `needles`.
void expect_config_error(const json& j, std::initializer_list<std::string_view> needles) {
  testing::expect_error([&] { parse(j); }, needles);
}

TEST(DeepseekV2Config, ParsesTheGoldenConfig) {
  const ModelConfig c = parse(golden_json());
  EXPECT_EQ(c.family->name(), "deepseek_v2");
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, true}));  // first_k_dense_replace = 1
  EXPECT_EQ(ds(c).q_lora_rank, 0);                                  // null: a plain q_proj
  EXPECT_EQ(ds(c).kv_lora_rank, 32);
  EXPECT_EQ(ds(c).qk_nope_head_dim, 32);
  EXPECT_EQ(ds(c).qk_rope_head_dim, 16);
  EXPECT_EQ(ds(c).v_head_dim, 32);
  EXPECT_EQ(ds(c).n_shared_experts, 1);
  EXPECT_FALSE(ds(c).yarn.has_value());
}

TEST(DeepseekV2Config, JsonRoundTripGivesBackTheConfig) {
  json j = golden_json();
  j["q_lora_rank"] = 24;
  j["topk_method"] = "group_limited_greedy";
  j["n_group"] = 4;
  j["topk_group"] = 2;
  j["routed_scaling_factor"] = 16.0;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0},
                          {"factor", 40.0},      {"original_max_position_embeddings", 4096},
                          {"mscale", 0.707},     {"mscale_all_dim", 0.707}};
  const ModelConfig c = parse(j);
  const ModelConfig back = parse_model_config(model_config_to_json(c), "written");
  EXPECT_EQ(back.moe_layers, c.moe_layers);
  EXPECT_EQ(ds(back).q_lora_rank, 24);
  EXPECT_EQ(ds(back).topk_method, "group_limited_greedy");
  EXPECT_EQ(ds(back).n_group, 4);
  EXPECT_EQ(ds(back).topk_group, 2);
  EXPECT_EQ(ds(back).routed_scaling_factor, 16.0);
  ASSERT_TRUE(ds(back).yarn.has_value());
  EXPECT_EQ(ds(back).yarn->factor, 40.0);
  EXPECT_EQ(ds(back).yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(ds(back).yarn->mscale_all_dim, 0.707);
}

TEST(DeepseekV2Config, QLoraBuildsTheLowRankQueryPath) {
  json j = golden_json();
  j["q_lora_rank"] = 24;
  const CausalLm model(parse(j));
  EXPECT_TRUE(model.params().contains("layers.0.attn.q_a_proj"));
  EXPECT_TRUE(model.params().contains("layers.0.attn.q_a_norm"));
  EXPECT_TRUE(model.params().contains("layers.0.attn.q_b_proj"));
  EXPECT_FALSE(model.params().contains("layers.0.attn.q_proj"));
  EXPECT_TRUE(model.params().contains("layers.1.shared_expert.gate_up"));
  EXPECT_FALSE(model.params().contains("layers.0.router")) << "layer 0 is dense";
}

TEST(DeepseekV2Config, RefusesEveryValueItDoesNotRun) {
  const auto with = [](const char* key, json value) {
    json j = golden_json();
    j[key] = std::move(value);
    return j;
  };
  expect_config_error(with("topk_method", "noaux_tc"), {"topk_method", "'noaux_tc'"});
  expect_config_error(with("scoring_func", "sigmoid"), {"scoring_func", "'sigmoid'"});
  expect_config_error(with("moe_layer_freq", 2), {"moe_layer_freq", "2"});
  expect_config_error(with("attention_bias", true), {"attention_bias"});
  expect_config_error(with("mlp_bias", true), {"mlp_bias"});
  expect_config_error(with("hidden_act", "gelu"), {"hidden_act", "'gelu'"});
  expect_config_error(with("num_key_value_heads", 2), {"num_key_value_heads (2)", "num_attention_heads (4)"});
  expect_config_error(with("head_dim", 32), {"head_dim (32)", "qk_rope_head_dim (16)"});
  expect_config_error(with("qk_rope_head_dim", 15), {"qk_rope_head_dim", "even"});
  expect_config_error(with("first_k_dense_replace", 4), {"first_k_dense_replace (4)"});
  expect_config_error(with("num_experts_per_tok", 9), {"num_experts_per_tok (9)", "n_routed_experts (8)"});
  expect_config_error(with("routed_scaling_factor", 0.0), {"routed_scaling_factor"});
  expect_config_error(with("q_lora_rank", -1), {"q_lora_rank"});
  json groups = with("topk_method", "group_limited_greedy");
  groups["n_group"] = 3;  // 8 experts do not split into 3 groups
  expect_config_error(groups, {"n_group (3)"});
  expect_config_error(with("rope_parameters", json{{"rope_type", "linear"}, {"factor", 2.0}}),
                      {"rope_type", "'linear'"});
  expect_config_error(with("rope_parameters", json{{"rope_type", "yarn"}, {"factor", 4.0}}),
                      {"original_max_position_embeddings"});
  expect_config_error(
      with("rope_parameters", json{{"rope_type", "yarn"}, {"factor", 0.5}, {"original_max_position_embeddings", 4096}}),
      {"factor"});
  // transformers would rotate only part of the rotary key.
  expect_config_error(with("partial_rotary_factor", 0.5), {"partial_rotary_factor 0.5", "deepseek_v2"});
  expect_config_error(with("rope_parameters", json{{"rope_type", "default"}, {"partial_rotary_factor", 0.5}}),
                      {"partial_rotary_factor 0.5", "deepseek_v2"});
  json missing = golden_json();
  missing.erase("kv_lora_rank");
  expect_config_error(missing, {"kv_lora_rank", "missing"});
}

TEST(DeepseekV2Config, IsCertifiedForExactMode) {
  const ModelConfig c = parse(golden_json());
  EXPECT_TRUE(c.family->exact_certification(c).certified);
}

}  // namespace
}  // namespace moetrain::model
