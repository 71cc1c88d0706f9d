// Tests for the Qwen3 and Qwen3-MoE families' config.json parsing (model/families/qwen3, qwen3_moe) through the
// registry (model/model_config.h): the golden config.json files, both spellings of renamed fields, the JSON writer's
// round trip, and one bad input per check.
#include "model/families/qwen3/config.h"

#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/families/qwen3_moe/config.h"
#include "model/family.h"
#include "model/model_config.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using families::qwen3::Qwen3Config;
using families::qwen3_moe::Qwen3MoeConfig;
using nlohmann::json;

// The family's own fields: Qwen3's (both families), and Qwen3-MoE's expert fields.
const Qwen3Config& q(const ModelConfig& c) { return c.family_config<Qwen3Config>(); }
const Qwen3MoeConfig& moe(const ModelConfig& c) { return c.family_config<Qwen3MoeConfig>(); }

// A minimal valid qwen3_moe config.json as a JSON object, for tests to edit.
json small_moe_json() {
  return json::parse(R"({
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 2,
    "num_experts": 4
  })");
}

json small_dense_json() {
  return json::parse(R"({
    "model_type": "qwen3",
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "rms_norm_eps": 1e-6
  })");
}

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }

// Parses `j` expecting an Error whose message holds every one of `needles`.
void expect_config_error(const json& j, std::initializer_list<std::string_view> needles) {
  testing::expect_error([&] { parse(j); }, needles);
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.moe_layers, b.moe_layers);
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(q(a).num_attention_heads, q(b).num_attention_heads);
  EXPECT_EQ(q(a).num_key_value_heads, q(b).num_key_value_heads);
  EXPECT_EQ(q(a).head_dim, q(b).head_dim);
  EXPECT_EQ(q(a).intermediate_size, q(b).intermediate_size);
  EXPECT_EQ(q(a).rms_norm_eps, q(b).rms_norm_eps);
  EXPECT_EQ(q(a).rope_theta, q(b).rope_theta);
  EXPECT_EQ(q(a).partial_rotary_factor, q(b).partial_rotary_factor);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(q(a).max_position_embeddings, q(b).max_position_embeddings);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  if (!a.is_moe()) return;
  EXPECT_EQ(moe(a).moe_intermediate_size, moe(b).moe_intermediate_size);
  EXPECT_EQ(moe(a).norm_topk_prob, moe(b).norm_topk_prob);
  EXPECT_EQ(moe(a).decoder_sparse_step, moe(b).decoder_sparse_step);
  EXPECT_EQ(moe(a).mlp_only_layers, moe(b).mlp_only_layers);
  EXPECT_EQ(moe(a).router_aux_loss_coef, moe(b).router_aux_loss_coef);
}

TEST(ModelConfig, ParsesGoldenQwen3) {
  const ModelConfig c = load_model_config(testing::test_data_path("golden/qwen3/config.json"));
  EXPECT_EQ(c.family->name(), "qwen3");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(q(c).num_attention_heads, 4);
  EXPECT_EQ(q(c).num_key_value_heads, 2);
  EXPECT_EQ(q(c).head_dim, 32);
  EXPECT_EQ(q(c).intermediate_size, 96);
  EXPECT_EQ(q(c).rms_norm_eps, 1e-6);
  EXPECT_EQ(q(c).rope_theta, 10000.0);
  EXPECT_EQ(q(c).partial_rotary_factor, 1.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(q(c).max_position_embeddings, 4096);
  EXPECT_FALSE(c.is_moe());
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_FALSE(c.layer_is_moe(1));
}

TEST(ModelConfig, ParsesGoldenQwen3Moe) {
  const ModelConfig c = load_model_config(testing::test_data_path("golden/qwen3_moe/config.json"));
  EXPECT_EQ(c.family->name(), "qwen3_moe");
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(q(c).num_attention_heads, 4);
  EXPECT_EQ(q(c).num_key_value_heads, 2);
  EXPECT_EQ(q(c).head_dim, 32);
  EXPECT_EQ(q(c).intermediate_size, 96);
  EXPECT_EQ(q(c).rope_theta, 10000.0);
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 8);  // spelled num_local_experts in the file
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(moe(c).moe_intermediate_size, 48);
  EXPECT_TRUE(moe(c).norm_topk_prob);
  EXPECT_EQ(moe(c).decoder_sparse_step, 1);
  EXPECT_EQ(moe(c).mlp_only_layers, (std::vector<int64_t>{0}));
  EXPECT_EQ(moe(c).router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_TRUE(c.layer_is_moe(2));
}

TEST(ModelConfig, LoadsFromModelFolder) {
  const ModelConfig c = load_model_config(testing::test_data_path("golden/qwen3_moe"));
  EXPECT_EQ(c.num_experts, 8);
}

TEST(ModelConfig, LoadNamesMissingFile) {
  try {
    load_model_config("/nonexistent/moetrain/config.json");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/moetrain/config.json"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, AcceptsBothExpertCountSpellings) {
  json j = small_moe_json();
  EXPECT_EQ(parse(j).num_experts, 4);
  j.erase("num_experts");
  j["num_local_experts"] = 6;
  EXPECT_EQ(parse(j).num_experts, 6);
  j["num_experts"] = 6;  // both, agreeing
  EXPECT_EQ(parse(j).num_experts, 6);
}

TEST(ModelConfig, AcceptsBothRopeSpellings) {
  json top = small_dense_json();
  top["rope_theta"] = 500000.0;
  top["rope_scaling"] = nullptr;
  EXPECT_EQ(q(parse(top)).rope_theta, 500000.0);

  json nested = small_dense_json();
  nested["rope_parameters"] = {{"rope_theta", 250000.0}, {"rope_type", "default"}, {"partial_rotary_factor", 0.5}};
  const ModelConfig c = parse(nested);
  EXPECT_EQ(q(c).rope_theta, 250000.0);
  EXPECT_EQ(q(c).partial_rotary_factor, 0.5);
}

TEST(ModelConfig, AppliesDefaults) {
  const ModelConfig c = parse(small_dense_json());
  EXPECT_EQ(q(c).num_key_value_heads, 4);  // = num_attention_heads
  EXPECT_EQ(q(c).head_dim, 8);             // = hidden_size / num_attention_heads
  EXPECT_EQ(q(c).rope_theta, 10000.0);
  EXPECT_EQ(q(c).partial_rotary_factor, 1.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_experts, 0);

  const ModelConfig m = parse(small_moe_json());
  EXPECT_FALSE(moe(m).norm_topk_prob);
  EXPECT_EQ(moe(m).decoder_sparse_step, 1);
  EXPECT_TRUE(moe(m).mlp_only_layers.empty());
  EXPECT_EQ(moe(m).router_aux_loss_coef, 0.0);
  for (int64_t l = 0; l < 4; ++l) EXPECT_TRUE(m.layer_is_moe(l)) << l;
}

TEST(ModelConfig, DecoderSparseStepSelectsMoeLayers) {
  json j = small_moe_json();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  const ModelConfig c = parse(j);
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_FALSE(c.layer_is_moe(2));
  EXPECT_FALSE(c.layer_is_moe(3));  // (3 + 1) % 2 == 0 but listed in mlp_only_layers
}

TEST(ModelConfig, JsonRoundTripGivesBackTheConfig) {
  for (const char* name : {"golden/qwen3/config.json", "golden/qwen3_moe/config.json"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = load_model_config(testing::test_data_path(name));
    const std::string text = model_config_to_json(c);
    expect_same(parse_model_config(text, "written"), c);
  }
  json j = small_moe_json();
  j["rope_parameters"] = {{"rope_theta", 123456.789}, {"rope_type", "default"}, {"partial_rotary_factor", 0.25}};
  j.erase("rope_theta");
  j["rms_norm_eps"] = 1.0 / 3.0;
  j["router_aux_loss_coef"] = 0.1;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {0, 3};
  j["tie_word_embeddings"] = true;
  j["head_dim"] = 16;
  j["norm_topk_prob"] = true;
  const ModelConfig c = parse(j);
  expect_same(parse_model_config(model_config_to_json(c), "written"), c);
}

TEST(ModelConfig, JsonWriterUsesTransformersNames) {
  const ModelConfig c = load_model_config(testing::test_data_path("golden/qwen3_moe/config.json"));
  const json j = json::parse(model_config_to_json(c));
  EXPECT_EQ(j.at("architectures"), json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(j.at("model_type"), "qwen3_moe");
  EXPECT_EQ(j.at("num_experts"), 8);
  EXPECT_EQ(j.at("rope_parameters").at("rope_type"), "default");
  EXPECT_EQ(j.at("rope_parameters").at("rope_theta"), 10000.0);
  EXPECT_EQ(j.at("dtype"), "float32");
  EXPECT_EQ(j.at("mlp_only_layers"), json::array({0}));

  const ModelConfig d = load_model_config(testing::test_data_path("golden/qwen3/config.json"));
  const json jd = json::parse(model_config_to_json(d));
  EXPECT_EQ(jd.at("architectures"), json::array({"Qwen3ForCausalLM"}));
  EXPECT_FALSE(jd.contains("num_experts"));
}

TEST(ModelConfig, JsonWriterKeepsTheSourceFieldsTheEngineDoesNotUse) {
  json j = small_moe_json();
  j["bos_token_id"] = 100000;
  j["eos_token_id"] = 100001;
  j["pad_token_id"] = nullptr;
  j["output_router_logits"] = true;
  j["dtype"] = "bfloat16";
  const json written = json::parse(model_config_to_json(parse(j)));
  EXPECT_EQ(written.at("bos_token_id"), 100000);
  EXPECT_EQ(written.at("eos_token_id"), 100001);
  EXPECT_TRUE(written.at("pad_token_id").is_null());
  EXPECT_EQ(written.at("output_router_logits"), true);
  EXPECT_EQ(written.at("dtype"), "float32") << "the engine's fields win: the export's weights are f32";
  EXPECT_EQ(written.at("num_experts"), 4);
}

// A checkpoint read from MXFP4 pairs (GPT-OSS's) is exported whole: its quantization_config does not follow.
TEST(ModelConfig, JsonWriterDropsTheSourceQuantizationConfig) {
  json j = small_moe_json();
  j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"lm_head"}}};
  j["bos_token_id"] = 7;
  const json written = json::parse(model_config_to_json(parse(j)));
  EXPECT_FALSE(written.contains("quantization_config")) << written.dump();
  EXPECT_EQ(written.at("bos_token_id"), 7);
}

TEST(ModelConfig, RejectsMissingRequiredField) {
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "rms_norm_eps", "moe_intermediate_size", "num_experts_per_tok"}) {
    json j = small_moe_json();
    j.erase(field);
    expect_config_error(j, {field, "missing", "test/config.json"});
  }
  json j = small_moe_json();
  j.erase("num_experts");
  expect_config_error(j, {"num_experts", "missing"});
  json d = small_dense_json();
  d.erase("model_type");
  expect_config_error(d, {"model_type", "missing"});
}

TEST(ModelConfig, RejectsWrongJsonType) {
  json j = small_dense_json();
  j["hidden_size"] = "32";
  expect_config_error(j, {"hidden_size", "integer", "string", "test/config.json"});
  j = small_dense_json();
  j["rms_norm_eps"] = "1e-6";
  expect_config_error(j, {"rms_norm_eps", "number"});
  j = small_dense_json();
  j["vocab_size"] = 100.5;
  expect_config_error(j, {"vocab_size", "integer"});
  j = small_dense_json();
  j["tie_word_embeddings"] = 1;
  expect_config_error(j, {"tie_word_embeddings", "true or false"});
  j = small_moe_json();
  j["mlp_only_layers"] = {"0"};
  expect_config_error(j, {"mlp_only_layers", "integers"});
  j = small_dense_json();
  j["rope_parameters"] = {{"rope_theta", "big"}};
  expect_config_error(j, {"rope_parameters.rope_theta", "number"});
}

TEST(ModelConfig, RejectsUnknownModelType) {
  json j = small_dense_json();
  j["model_type"] = "llama";
  expect_config_error(j, {"model_type", "'llama'", "qwen3, ", "qwen3_moe", "qwen3_5_text"});
}

TEST(ModelConfig, RejectsMalformedJson) {
  try {
    parse_model_config("{\"model_type\": \"qwen3\",, }", "bad/config.json");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("bad/config.json"), std::string::npos) << message;
    EXPECT_NE(message.find("at byte 24"), std::string::npos) << message;
  }
}

TEST(ModelConfig, RejectsHeadsNotDivisible) {
  json j = small_dense_json();
  j["num_key_value_heads"] = 3;
  expect_config_error(j, {"num_attention_heads (4)", "num_key_value_heads (3)"});
}

TEST(ModelConfig, RejectsConflictingExpertCounts) {
  json j = small_moe_json();
  j["num_local_experts"] = 8;
  expect_config_error(j, {"num_experts (4)", "num_local_experts (8)"});
}

TEST(ModelConfig, RejectsUnsupportedRopeType) {
  json j = small_dense_json();
  j["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "yarn"}, {"factor", 4.0}};
  expect_config_error(j, {"rope_type", "'yarn'"});
  j = small_dense_json();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  expect_config_error(j, {"rope_scaling.rope_type", "'linear'"});
}

TEST(ModelConfig, RejectsConflictingRopeTheta) {
  json j = small_dense_json();
  j["rope_theta"] = 10000.0;
  j["rope_parameters"] = {{"rope_theta", 20000.0}, {"rope_type", "default"}};
  expect_config_error(j, {"rope_theta"});
}

TEST(ModelConfig, RefusesWhatTheFamilyDoesNotRun) {
  json j = small_dense_json();
  j["attention_bias"] = true;
  expect_config_error(j, {"attention_bias", "not supported"});
  j = small_dense_json();
  j["use_sliding_window"] = true;
  expect_config_error(j, {"use_sliding_window", "not supported"});
  j = small_moe_json();
  j["hidden_act"] = "gelu";
  expect_config_error(j, {"hidden_act", "'gelu'", "silu"});
  j = small_dense_json();
  j["head_dim"] = 33;  // an odd rotary dimension: transformers cannot run it either
  expect_config_error(j, {"head_dim (33)", "even"});
  j = small_dense_json();
  j["head_dim"] = 32;
  j["partial_rotary_factor"] = 0.3;  // 9.6 rotary dims would be rounded without a word
  expect_config_error(j, {"partial_rotary_factor", "rotary dims"});
}

TEST(ModelConfig, RejectsBytesAfterTheDocument) {
  const std::string text = small_dense_json().dump();
  EXPECT_THROW(parse_model_config(text + std::string(1, '\0') + "GARBAGE", "nul/config.json"), Error);
  EXPECT_THROW(parse_model_config(text + " {}", "two/config.json"), Error);
}

TEST(ModelConfig, RejectsOutOfRangeValues) {
  json j = small_dense_json();
  j["hidden_size"] = 0;
  expect_config_error(j, {"hidden_size", "positive", "0"});
  j = small_moe_json();
  j["num_experts_per_tok"] = 5;
  expect_config_error(j, {"num_experts_per_tok (5)", "num_experts (4)"});
  j = small_moe_json();
  j["mlp_only_layers"] = {4};
  expect_config_error(j, {"mlp_only_layers", "4", "num_hidden_layers = 4"});
  j = small_moe_json();
  j["mlp_only_layers"] = {-1};
  expect_config_error(j, {"mlp_only_layers", "-1"});
  j = small_moe_json();
  j["num_experts"] = 0;
  expect_config_error(j, {"num_experts", "positive"});
}

}  // namespace
}  // namespace moetrain::model
