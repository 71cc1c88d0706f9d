// Tests for the GPT-OSS family's config.json parsing (model/families/gpt_oss): the golden config, the released
// models' spelling (rope_scaling and rope_theta at the top level, experts_per_token, swiglu_limit, an MXFP4
// quantization_config), GptOssConfig's defaults, the writer's round trip, the export's dropped fields, and a refusal
// for every value it does not run.
#include "model/families/gpt_oss/config.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/family.h"
#include "model/model_config.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using families::gpt_oss::GptOssConfig;
using nlohmann::json;

json golden_json() { return io::read_json_object(testing::test_data_path("golden/gpt_oss/config.json")); }

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }
const GptOssConfig& oss(const ModelConfig& c) { return c.family_config<GptOssConfig>(); }

// Parses `j` expecting an Error whose message holds every one of `needles`.
void expect_config_error(const json& j, std::initializer_list<std::string_view> needles) {
  testing::expect_error([&] { parse(j); }, needles);
}

TEST(GptOssConfig, ParsesTheGoldenConfig) {
  const ModelConfig c = parse(golden_json());
  EXPECT_EQ(c.family->name(), "gpt_oss");
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(oss(c).head_dim, 32);
  EXPECT_EQ(oss(c).num_key_value_heads, 2);
  EXPECT_TRUE(oss(c).attention_bias);
  EXPECT_EQ(oss(c).sliding_window, 8);
  EXPECT_EQ(oss(c).sliding_layers, (std::vector<bool>{true, false}));
  ASSERT_TRUE(oss(c).yarn.has_value());
  EXPECT_EQ(oss(c).yarn->factor, 32.0);
  EXPECT_FALSE(oss(c).yarn->truncate);
  EXPECT_EQ(oss(c).rope_theta, 150000.0);
  EXPECT_FALSE(oss(c).mxfp4_checkpoint);
}

TEST(GptOssConfig, DefaultsAreGptOssConfigs) {
  json j = golden_json();
  j.erase("layer_types");
  j.erase("rope_parameters");
  j["num_hidden_layers"] = 3;
  const ModelConfig c = parse(j);
  EXPECT_EQ(oss(c).sliding_layers, (std::vector<bool>{true, false, true}));  // even layers slide
  ASSERT_TRUE(oss(c).yarn.has_value());  // no rope dict: YaRN, factor 32 over 4096 positions, no truncation
  EXPECT_EQ(oss(c).yarn->factor, 32.0);
  EXPECT_EQ(oss(c).yarn->original_max_position_embeddings, 4096);
  EXPECT_FALSE(oss(c).yarn->truncate);
  EXPECT_EQ(oss(c).rope_theta, 150000.0);
}

// The released gpt-oss-20b config.json (written by transformers 4.55), at the golden model's sizes.
TEST(GptOssConfig, ReadsTheReleasedSpelling) {
  json j = golden_json();
  j.erase("rope_parameters");
  j["rope_theta"] = 150000;
  j["rope_scaling"] = {{"beta_fast", 32.0},   {"beta_slow", 1.0},
                       {"factor", 32.0},      {"original_max_position_embeddings", 4096},
                       {"rope_type", "yarn"}, {"truncate", false}};
  j["experts_per_token"] = 2;
  j["swiglu_limit"] = 7.0;
  j["initial_context_length"] = 4096;
  j["quantization_config"] = {{"quant_method", "mxfp4"},
                              {"modules_to_not_convert", {"model.layers.*.self_attn", "model.embed_tokens"}}};
  const ModelConfig c = parse(j);
  EXPECT_TRUE(oss(c).mxfp4_checkpoint);
  ASSERT_TRUE(oss(c).yarn.has_value());
  EXPECT_FALSE(oss(c).yarn->truncate);
  // The export is float and spells the rope once, in rope_parameters: the quantisation and the legacy rope fields of
  // the source are not carried over; every other unknown field is.
  ModelConfig read = c;
  read.hf_source_json = j.dump();
  const json written = io::parse_json_object(model_config_to_json(read), "export");
  EXPECT_FALSE(written.contains("quantization_config"));
  EXPECT_FALSE(written.contains("rope_scaling"));
  EXPECT_FALSE(written.contains("rope_theta"));
  EXPECT_EQ(written.at("rope_parameters").at("rope_type"), "yarn");
  EXPECT_EQ(written.at("initial_context_length"), 4096);
  EXPECT_EQ(written.at("experts_per_token"), 2);
}

TEST(GptOssConfig, JsonRoundTripGivesBackTheConfig) {
  json j = golden_json();
  j["attention_bias"] = false;
  j["sliding_window"] = nullptr;
  j["layer_types"] = {"full_attention", "sliding_attention"};
  const ModelConfig a = parse(j);
  const ModelConfig b = parse(io::parse_json_object(model_config_to_json(a), "round trip"));
  EXPECT_EQ(b.num_experts, a.num_experts);
  EXPECT_EQ(oss(b).attention_bias, false);
  EXPECT_EQ(oss(b).sliding_window, 0);
  EXPECT_EQ(oss(b).sliding_layers, (std::vector<bool>{false, true}));
  EXPECT_EQ(oss(b).yarn->factor, oss(a).yarn->factor);
  EXPECT_EQ(oss(b).yarn->truncate, oss(a).yarn->truncate);
  EXPECT_EQ(oss(b).rope_theta, oss(a).rope_theta);
  EXPECT_EQ(oss(b).head_dim, oss(a).head_dim);
}

TEST(GptOssConfig, RefusesWhatItDoesNotRun) {
  const auto with = [](const char* key, json value) {
    json j = golden_json();
    j[key] = std::move(value);
    return j;
  };
  expect_config_error(with("attention_dropout", 0.1), {"attention_dropout", "0.1"});
  expect_config_error(with("hidden_act", "gelu"), {"hidden_act", "gelu"});
  expect_config_error(with("swiglu_limit", 10.0), {"swiglu_limit", "10"});
  expect_config_error(with("experts_per_token", 3), {"experts_per_token", "num_experts_per_tok"});
  expect_config_error(with("layer_types", json{"sliding_attention"}),
                      {"layer_types", "1 entries", "num_hidden_layers"});
  expect_config_error(with("layer_types", json{"sliding_attention", "chunked_attention"}),
                      {"layer_types[1]", "chunked_attention"});
  expect_config_error(with("sliding_window", -4), {"sliding_window", "-4"});
  expect_config_error(with("num_key_value_heads", 3), {"num_attention_heads", "num_key_value_heads"});
  expect_config_error(with("head_dim", 31), {"head_dim", "even"});
  expect_config_error(with("num_experts_per_tok", 9), {"num_experts_per_tok", "num_local_experts"});
  expect_config_error(with("quantization_config", json{{"quant_method", "fp8"}}), {"quant_method", "fp8", "mxfp4"});
  expect_config_error(with("rope_parameters", json{{"rope_type", "llama3"}, {"rope_theta", 10000.0}}),
                      {"rope_type", "llama3"});
  expect_config_error(with("rope_parameters", json{{"rope_type", "yarn"}, {"factor", 4.0}}),
                      {"original_max_position_embeddings"});
  expect_config_error(with("partial_rotary_factor", 0.5), {"partial_rotary_factor 0.5", "gpt_oss"});
  json no_experts = golden_json();
  no_experts.erase("num_local_experts");
  expect_config_error(no_experts, {"num_local_experts"});
}

}  // namespace
}  // namespace moetrain::model
