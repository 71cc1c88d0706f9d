// Tests for the bounds on model sizes (issue 20, "Crashes"): every recipe of examples/tiny_moe/config.json with one
// field made huge is refused with an error naming the field, in milliseconds and before anything is allocated; sizes
// inside the bounds whose parameters cannot fit the host are refused by the parameter store before it allocates.
#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/allocator.h"
#include "core/error.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

nlohmann::json tiny_moe_json() {
  std::ifstream in(testing::repo_path("examples/tiny_moe/config.json"));
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

// Parses the tiny config with `field` set to `value` and builds the model; the error must name every word in
// `words`, come within a second and leave no bytes allocated.
void expect_refused(const std::string& field, int64_t value, std::initializer_list<std::string> words) {
  nlohmann::json config = tiny_moe_json();
  config[field] = value;
  const int64_t live_before = memory_stats(DeviceKind::CPU).live_bytes;
  const auto start = std::chrono::steady_clock::now();
  try {
    const CausalLm model(parse_model_config(config.dump(), "huge/config.json"));
    ADD_FAILURE() << field << " = " << value << " was accepted";
  } catch (const Error& e) {
    for (const std::string& word : words) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << field << ": " << e.what();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0) << field << " = " << value << " took " << seconds << " s to refuse";
  EXPECT_EQ(memory_stats(DeviceKind::CPU).live_bytes, live_before) << field << " left bytes allocated";
}

TEST(OversizeConfig, IssueRecipesAreRefusedNamingTheField) {
  expect_refused("hidden_size", int64_t{1} << 62, {"huge/config.json", "hidden_size", "4611686018427387904"});
  expect_refused("moe_intermediate_size", int64_t{1} << 57, {"huge/config.json", "moe_intermediate_size"});
  expect_refused("num_attention_heads", int64_t{1} << 60, {"huge/config.json", "num_attention_heads"});
  expect_refused("vocab_size", int64_t{1} << 57, {"huge/config.json", "vocab_size"});
  expect_refused("vocab_size", (int64_t{1} << 58) + 1, {"huge/config.json", "vocab_size", "288230376151711745"});
  expect_refused("vocab_size", int64_t{1} << 62, {"huge/config.json", "vocab_size"});
}

TEST(OversizeConfig, LayerAndExpertCountsAreBoundedUpFront) {
  expect_refused("num_hidden_layers", int64_t{1} << 31, {"num_hidden_layers", "2147483648", "65536"});
  expect_refused("num_experts", int64_t{1} << 31, {"num_experts", "2147483648", "65536"});
}

TEST(OversizeConfig, ParametersThatCannotFitTheHostAreRefusedBeforeAllocating) {
  // Inside the per-field bound of 2^24, but 8 layers of 8 experts of [128, 2^24] are terabytes of fp32.
  expect_refused("hidden_size", int64_t{1} << 24, {"parameter store", "bytes of memory this host has"});
  expect_refused("moe_intermediate_size", int64_t{1} << 24, {"parameter store", "bytes of memory this host has"});
}

}  // namespace
}  // namespace moetrain::model
