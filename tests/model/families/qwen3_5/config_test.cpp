// Tests for the Qwen3.5 family's config.json parsing (model/families/qwen3_5): the golden dense and MoE configs,
// transformers' defaults (layer_types from full_attention_interval, partial_rotary_factor 0.25), the legacy layer type
// names, the multimodal wrappers read through their text_config, the writer's round trip, and a refusal for every
// value it does not run.
#include "model/families/qwen3_5/config.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/family.h"
#include "model/model_config.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using families::qwen3_5::Qwen3_5Config;
using nlohmann::json;

json golden_json(const std::string& dump) {
  return io::read_json_object(testing::test_data_path("golden/" + dump + "/config.json"));
}

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }
const Qwen3_5Config& own(const ModelConfig& c) { return c.family_config<Qwen3_5Config>(); }

// Parses `j` expecting an Error whose message holds every one of `needles`.
void expect_config_error(const json& j, std::initializer_list<std::string_view> needles) {
  testing::expect_error([&] { parse(j); }, needles);
}

TEST(Qwen3_5Config, ParsesTheGoldenDenseConfig) {
  const ModelConfig c = parse(golden_json("qwen3_5"));
  EXPECT_EQ(c.family->name(), "qwen3_5");
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_FALSE(c.is_moe());
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, false, false, false}));
  EXPECT_FALSE(own(c).moe);
  EXPECT_EQ(own(c).linear_layers, (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(own(c).num_attention_heads, 4);
  EXPECT_EQ(own(c).num_key_value_heads, 2);
  EXPECT_EQ(own(c).head_dim, 32);
  EXPECT_EQ(own(c).rotary_dim(), 8);
  EXPECT_EQ(own(c).linear_num_key_heads, 2);
  EXPECT_EQ(own(c).linear_num_value_heads, 4);
  EXPECT_EQ(own(c).linear_key_head_dim, 16);
  EXPECT_EQ(own(c).linear_value_head_dim, 16);
  EXPECT_EQ(own(c).linear_conv_kernel_dim, 4);
  EXPECT_EQ(own(c).intermediate_size, 96);
  EXPECT_EQ(own(c).rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.family->final_norm(c).zero_centered);
}

TEST(Qwen3_5Config, ParsesTheGoldenMoeConfig) {
  const ModelConfig c = parse(golden_json("qwen3_5_moe"));
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_TRUE(own(c).moe);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, true, true, true}));  // every layer routes
  EXPECT_EQ(own(c).moe_intermediate_size, 32);
  EXPECT_EQ(own(c).shared_expert_intermediate_size, 32);
  EXPECT_EQ(own(c).router_aux_loss_coef, 0.001);
}

TEST(Qwen3_5Config, DefaultsAreTransformers) {
  json j = golden_json("qwen3_5");
  for (const char* field :
       {"layer_types", "rope_parameters", "partial_rotary_factor", "head_dim", "linear_conv_kernel_dim"})
    j.erase(field);
  j["num_hidden_layers"] = 8;
  j["hidden_size"] = 64;
  const ModelConfig c = parse(j);
  // Every 4th layer (full_attention_interval's default) is full attention.
  EXPECT_EQ(own(c).linear_layers, (std::vector<bool>{true, true, true, false, true, true, true, false}));
  EXPECT_EQ(own(c).partial_rotary_factor, 0.25);
  EXPECT_EQ(own(c).head_dim, 256);
  EXPECT_EQ(own(c).rotary_dim(), 64);
  EXPECT_EQ(own(c).linear_conv_kernel_dim, 4);
  EXPECT_EQ(own(c).rope_theta, 10000.0);

  j["full_attention_interval"] = 2;
  EXPECT_EQ(own(parse(j)).linear_layers, (std::vector<bool>{true, false, true, false, true, false, true, false}));
}

TEST(Qwen3_5Config, ReadsLegacyLayerTypeNamesAndMropeFields) {
  json j = golden_json("qwen3_5");
  j["layer_types"] = {"mamba", "attention", "linear_attention", "full_attention"};
  j["rope_parameters"]["mrope_section"] = {11, 11, 10};
  j["rope_parameters"]["mrope_interleaved"] = true;
  const ModelConfig c = parse(j);
  EXPECT_EQ(own(c).linear_layers, (std::vector<bool>{true, false, true, false}));
}

// The released multimodal config.json: the text model inside text_config, a vision tower beside it.
TEST(Qwen3_5Config, TrainsTheTextConfigOfTheMultimodalWrappers) {
  for (const char* dump : {"qwen3_5", "qwen3_5_moe"}) {
    SCOPED_TRACE(dump);
    json text = golden_json(dump);
    const std::string text_type = text["model_type"];
    json wrapper = {{"model_type", std::string(dump)},
                    {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                    {"image_token_id", 248056},
                    {"text_config", text},
                    {"vision_config", {{"depth", 2}, {"hidden_size", 32}}}};
    ModelConfig c = parse(wrapper);
    EXPECT_EQ(c.model_type, text_type);
    EXPECT_EQ(c.num_hidden_layers, 4);
    EXPECT_EQ(c.is_moe(), std::string(dump) == "qwen3_5_moe");
    // The export is the text model's config.json: no vision tower, no wrapper fields.
    const json exported = json::parse(model_config_to_json(c));
    EXPECT_EQ(exported["model_type"], text_type);
    EXPECT_FALSE(exported.contains("vision_config"));
    EXPECT_FALSE(exported.contains("text_config"));
    // A text_config without its own model_type stands for the wrapper's text model.
    wrapper["text_config"].erase("model_type");
    EXPECT_EQ(parse(wrapper).model_type, text_type);
  }
}

TEST(Qwen3_5Config, WriterRoundTrips) {
  for (const char* dump : {"qwen3_5", "qwen3_5_moe"}) {
    SCOPED_TRACE(dump);
    const ModelConfig c = parse(golden_json(dump));
    const ModelConfig back = parse(json::parse(c.family->to_hf_config_json(c)));
    EXPECT_EQ(back.model_type, c.model_type);
    EXPECT_EQ(back.moe_layers, c.moe_layers);
    EXPECT_EQ(back.num_experts, c.num_experts);
    EXPECT_EQ(own(back).linear_layers, own(c).linear_layers);
    EXPECT_EQ(own(back).partial_rotary_factor, own(c).partial_rotary_factor);
    EXPECT_EQ(own(back).linear_num_value_heads, own(c).linear_num_value_heads);
    EXPECT_EQ(own(back).shared_expert_intermediate_size, own(c).shared_expert_intermediate_size);
    EXPECT_EQ(own(back).intermediate_size, own(c).intermediate_size);
  }
}

TEST(Qwen3_5Config, RefusesWhatItDoesNotRun) {
  const json dense = golden_json("qwen3_5");
  const json moe = golden_json("qwen3_5_moe");
  const auto with = [](json j, const std::string& field, const json& value) {
    j[field] = value;
    return j;
  };
  expect_config_error(with(dense, "attention_bias", true), {"attention_bias = true is not supported for qwen3_5"});
  expect_config_error(with(dense, "attention_dropout", 0.1), {"attention_dropout 0.1 is not supported"});
  expect_config_error(with(dense, "hidden_act", "gelu"), {"hidden_act 'gelu' is not supported for qwen3_5"});
  expect_config_error(
      with(dense, "layer_types", {"linear_attention", "sliding_attention", "linear_attention", "full_attention"}),
      {"layer_types[1] 'sliding_attention' is not supported for qwen3_5"});
  expect_config_error(with(dense, "layer_types", {"linear_attention", "full_attention"}),
                      {"layer_types has 2 entries but num_hidden_layers is 4"});
  expect_config_error(with(dense, "rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}}),
                      {"rope_parameters.rope_type 'yarn' is not supported for qwen3_5"});
  expect_config_error(with(dense, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}),
                      {"rope_scaling.type 'linear' is not supported for qwen3_5"});
  expect_config_error(with(dense, "rope_theta", 500.0),
                      {"rope_theta is 500 at the top level but 10000 in rope_parameters"});
  expect_config_error(with(with(dense, "partial_rotary_factor", 0.3), "rope_parameters",
                           {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.3}}),
                      {"gives 9.6 rotary dims; rope needs a whole, even number"});
  expect_config_error(with(dense, "linear_num_value_heads", 3),
                      {"linear_num_value_heads (3) is not divisible by linear_num_key_heads (2)"});
  expect_config_error(with(dense, "num_key_value_heads", 3), {"num_attention_heads (4) is not divisible by"});
  expect_config_error(with(dense, "linear_conv_kernel_dim", 0), {"linear_conv_kernel_dim must be positive"});
  expect_config_error(with(dense, "linear_key_head_dim", -16), {"linear_key_head_dim must be positive"});
  expect_config_error(with(dense, "intermediate_size", 0), {"intermediate_size must be positive"});
  json no_types = with(dense, "full_attention_interval", 0);
  no_types.erase("layer_types");
  expect_config_error(no_types, {"full_attention_interval must be positive"});
  expect_config_error(with(moe, "num_experts_per_tok", 9), {"num_experts_per_tok (9) exceeds num_experts (8)"});
  expect_config_error(with(moe, "norm_topk_prob", false), {"norm_topk_prob = false is not supported for qwen3_5_moe"});
  expect_config_error(with(moe, "shared_expert_intermediate_size", 0),
                      {"shared_expert_intermediate_size must be positive"});
  expect_config_error(with(moe, "moe_intermediate_size", 0), {"moe_intermediate_size must be positive"});
  // The wrappers need their text_config, which is a text model's.
  expect_config_error(json{{"model_type", "qwen3_5"}, {"vision_config", json::object()}},
                      {"model_type 'qwen3_5' keeps the model's config in the object 'text_config', which is missing"});
  expect_config_error(json{{"model_type", "qwen3_5"}, {"text_config", {{"model_type", "qwen3_5"}}}},
                      {"wraps its model in 'text_config', but it is itself the wrapped config"});
  // A wrapped model_type that is not a string (found by the fuzzer: it escaped as a JSON library exception).
  expect_config_error(json{{"model_type", "qwen3_5_moe"}, {"text_config", {{"model_type", 512}}}},
                      {"field 'text_config.model_type' must be a string but found"});
}

}  // namespace
}  // namespace moetrain::model
