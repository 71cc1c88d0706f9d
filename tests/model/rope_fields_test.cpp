// Tests for the rope fields every family reads (model/rope_fields.h) and the fields several families read alike
// (model/model_config.h): each place a config spells the rope, values spelled twice, the rope types a family accepts
// (refused by name, with the supported list), and the refusals of the shared readers.
#include "model/rope_fields.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_fields.h"
#include "model/model_config.h"
#include "testing/error_message.h"

namespace moetrain::model {
namespace {

using nlohmann::json;

RopeFields read(const json& top, const std::vector<std::string>& types = {"default"}) {
  return parse_rope_fields(io::JsonFields(top, "test/config.json"), "test_family", types);
}

using moetrain::testing::error_message;

TEST(RopeFields, AConfigWithoutRopeFieldsLeavesEveryValueToTheFamily) {
  const RopeFields r = read(json{{"hidden_size", 8}});
  EXPECT_FALSE(r.rope_theta.has_value());
  EXPECT_FALSE(r.partial_rotary_factor.has_value());
  EXPECT_FALSE(r.yarn.has_value());
  EXPECT_FALSE(r.any_rope_dict);
}

TEST(RopeFields, ReadsEachPlaceTransformersSpellsTheRope) {
  const RopeFields top = read(json{{"rope_theta", 5e5}, {"partial_rotary_factor", 0.5}, {"rope_scaling", nullptr}});
  EXPECT_EQ(top.rope_theta, 5e5);
  EXPECT_EQ(top.partial_rotary_factor, 0.5);
  EXPECT_FALSE(top.any_rope_dict);  // a null rope_scaling is no scaling

  const RopeFields nested = read(
      json{{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 2.5e5}, {"partial_rotary_factor", 0.25}}}});
  EXPECT_EQ(nested.rope_theta, 2.5e5);
  EXPECT_EQ(nested.partial_rotary_factor, 0.25);
  EXPECT_TRUE(nested.any_rope_dict);

  // The older key "type", in the older dict.
  const RopeFields legacy = read(json{{"rope_scaling", {{"type", "default"}, {"rope_theta", 1e4}}}});
  EXPECT_EQ(legacy.rope_theta, 1e4);
  EXPECT_TRUE(legacy.any_rope_dict);
}

TEST(RopeFields, AValueSpelledTwiceMustAgree) {
  const RopeFields same = read(json{{"rope_theta", 1e6}, {"rope_parameters", {{"rope_theta", 1e6}}}});
  EXPECT_EQ(same.rope_theta, 1e6);
  const std::string theta = error_message([] {
    read(json{{"rope_theta", 1e6}, {"rope_parameters", {{"rope_theta", 2e6}}}});
  });
  EXPECT_NE(theta.find("rope_theta is 1000000 at the top level but 2000000 in rope_parameters"), std::string::npos)
      << theta;
  // Two dicts that disagree: the error names both, not the top level.
  const std::string dicts = error_message([] {
    read(json{{"rope_parameters", {{"rope_theta", 1e4}}}, {"rope_scaling", {{"rope_theta", 2e4}}}});
  });
  EXPECT_NE(dicts.find("rope_theta is 10000 in rope_parameters but 20000 in rope_scaling"), std::string::npos) << dicts;
  const std::string partial = error_message([] {
    read(json{{"partial_rotary_factor", 0.5}, {"rope_scaling", {{"partial_rotary_factor", 0.25}}}});
  });
  EXPECT_NE(partial.find("partial_rotary_factor is 0.5 at the top level but 0.25 in rope_scaling"), std::string::npos)
      << partial;
}

TEST(RopeFields, RefusesARopeTypeTheFamilyDoesNotRunNamingTheFieldAndTheFamily) {
  const std::string plain = error_message([] {
    read(json{{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}}}});
  });
  for (const char* needle :
       {"test/config.json", "rope_parameters.rope_type 'yarn'", "test_family", "supported: default"})
    EXPECT_NE(plain.find(needle), std::string::npos) << plain << " lacks " << needle;
  const std::string legacy = error_message([] { read(json{{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}); });
  EXPECT_NE(legacy.find("rope_scaling.type 'linear'"), std::string::npos) << legacy;
  const std::string yarn_family = error_message([] {
    read(json{{"rope_parameters", {{"rope_type", "llama3"}}}}, {"default", "yarn"});
  });
  EXPECT_NE(yarn_family.find("supported: default, yarn"), std::string::npos) << yarn_family;
}

TEST(RopeFields, ReadsRopeTypeBeforeTheOlderKeyAndRefusesTheTwoDisagreeing) {
  const json yarn{{"rope_type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 4096}};
  json both = yarn;
  both["type"] = "yarn";
  EXPECT_TRUE(read(json{{"rope_parameters", both}}, {"default", "yarn"}).yarn.has_value());
  json legacy = yarn;
  legacy.erase("rope_type");
  legacy["type"] = "yarn";
  EXPECT_TRUE(read(json{{"rope_scaling", legacy}}, {"default", "yarn"}).yarn.has_value());
  // transformers would run YaRN here (rope_type first): reading "type" would silently run the default rope.
  json contradicting = yarn;
  contradicting["type"] = "default";
  const std::string m = error_message([&] { read(json{{"rope_parameters", contradicting}}, {"default", "yarn"}); });
  EXPECT_NE(m.find("rope_parameters.rope_type 'yarn' and rope_parameters.type 'default' disagree"), std::string::npos)
      << m;
}

TEST(RopeFields, ReadsYarnOnlyForAFamilyThatAcceptsIt) {
  const json top{
      {"max_position_embeddings", 32768},
      {"rope_parameters",
       {{"rope_type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 4096}, {"rope_theta", 1e4}}}};
  const RopeFields r = read(top, {"default", "yarn"});
  ASSERT_TRUE(r.yarn.has_value());
  EXPECT_EQ(r.yarn->factor, 8.0);
  EXPECT_EQ(r.yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(r.rope_theta, 1e4);
  EXPECT_THROW(read(top), Error);
}

TEST(RopeFields, RefusesARopeThetaOrPartialFactorOutOfRange) {
  EXPECT_NE(error_message([] {
              read(json{{"rope_theta", 0.0}});
            }).find("rope_theta must be positive but is 0"),
            std::string::npos);
  EXPECT_NE(error_message([] {
              read(json{{"rope_parameters", {{"partial_rotary_factor", 1.5}}}});
            }).find("partial_rotary_factor must be in (0, 1] but is 1.5"),
            std::string::npos);
}

TEST(RopeFields, AFamilyThatRotatesEveryDimRefusesAPartialFactor) {
  require_full_rotary(read(json{{"partial_rotary_factor", 1.0}}), "test/config.json", "test_family");
  require_full_rotary(read(json::object()), "test/config.json", "test_family");
  const std::string m = error_message([] {
    require_full_rotary(read(json{{"partial_rotary_factor", 0.5}}), "test/config.json", "test_family");
  });
  EXPECT_NE(m.find("partial_rotary_factor 0.5 is not supported for test_family"), std::string::npos) << m;
}

TEST(SharedConfigFields, ReadAndRefuseAlikeInEveryFamily) {
  const auto fields = [](const json& j) { return io::JsonFields(j, "test/config.json"); };
  const json none = json::object();
  EXPECT_EQ(parse_max_position_embeddings(fields(none)), 0);
  EXPECT_EQ(parse_max_position_embeddings(fields(json{{"max_position_embeddings", 4096}})), 4096);
  const json negative{{"max_position_embeddings", -1}};
  EXPECT_NE(
      error_message([&] { parse_max_position_embeddings(fields(negative)); }).find("must not be negative but is -1"),
      std::string::npos);

  require_silu_activation(fields(none), "test_family");
  require_silu_activation(fields(json{{"hidden_act", "silu"}}), "test_family");
  const json gelu{{"hidden_act", "gelu"}};
  EXPECT_NE(error_message([&] {
              require_silu_activation(fields(gelu), "test_family");
            }).find("hidden_act 'gelu' is not supported for test_family (only 'silu')"),
            std::string::npos);

  EXPECT_EQ(parse_rms_norm_eps(fields(none), 1e-5), 1e-5);
  EXPECT_EQ(parse_rms_norm_eps(fields(json{{"rms_norm_eps", 1e-6}})), 1e-6);
  EXPECT_NE(error_message([&] { parse_rms_norm_eps(fields(none)); }).find("rms_norm_eps"), std::string::npos);
  const json zero{{"rms_norm_eps", 0.0}};
  EXPECT_NE(
      error_message([&] { parse_rms_norm_eps(fields(zero), 1e-6); }).find("rms_norm_eps must be positive but is 0"),
      std::string::npos);
}

TEST(SharedConfigFields, TheShapeIsWrittenAsTransformersReadsIt) {
  ModelConfig g;
  g.vocab_size = 100;
  g.hidden_size = 16;
  g.num_hidden_layers = 3;
  g.tie_word_embeddings = true;
  const json j = model_shape_json(g);
  EXPECT_EQ(j, (json{{"vocab_size", 100},
                     {"hidden_size", 16},
                     {"num_hidden_layers", 3},
                     {"tie_word_embeddings", true},
                     {"dtype", "float32"}}));
}

}  // namespace
}  // namespace moetrain::model
