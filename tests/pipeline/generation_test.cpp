// Tests of generate (pipeline/generation.h): the KV-cached decoding against the full forward that `score` runs. For
// every sequence generate makes, scoring the whole sequence at once gives, bit for bit, the log-probs generate
// reported, and greedy decoding picks each position's argmax of the full forward's logits; in exact mode and out of
// it, greedy and sampled, for the tiny Qwen3-MoE example, GPT-OSS (sinks, and a sliding window shorter than the
// sequences), DeepSeek-V2 (latent attention) and Qwen3.5 dense and MoE (Gated DeltaNet). Every bad request is refused
// by name.
#include "pipeline/generation.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/decode_cache.h"
#include "model/model_config.h"
#include "pipeline/plain_executor.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

std::unique_ptr<model::CausalLm> golden_model(const std::string& family, uint64_t seed) {
  return fixtures::make_model(model::load_model_config(testing::test_data_path("golden/" + family + "/config.json")),
                              seed);
}

GenerationRequest request_of(const std::vector<std::vector<int32_t>>& prompts, int64_t new_tokens, double temperature,
                             uint64_t seed) {
  int64_t width = 0;
  for (const auto& p : prompts) width = std::max<int64_t>(width, static_cast<int64_t>(p.size()));
  const int64_t rows = static_cast<int64_t>(prompts.size());
  std::vector<int32_t> ids(static_cast<size_t>(rows * width), 7);  // padding past a prompt: any value
  GenerationRequest request;
  for (int64_t b = 0; b < rows; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    std::copy(p.begin(), p.end(), ids.begin() + b * width);
    request.lengths.push_back(static_cast<int32_t>(p.size()));
  }
  request.input_ids = Tensor::from_vector(ids, {rows, width});
  request.max_new_tokens = new_tokens;
  request.temperature = temperature;
  request.seed = seed;
  return request;
}

// Scores one generated row in a single full forward (the path `score` runs) and checks generate's log-probs bit for
// bit; with greedy decoding, each generated token is the argmax of the full forward's logits at its position.
void expect_row_matches_score(const model::CausalLm& model, const GenerationRequest& request, const Generation& out,
                              int64_t b) {
  SCOPED_TRACE("row " + std::to_string(b));
  const int64_t width = request.input_ids.size(1), steps = request.max_new_tokens;
  const int32_t len = request.lengths[static_cast<size_t>(b)];
  const int32_t* row = out.tokens.data<int32_t>() + b * (width + steps);
  for (int64_t t = 0; t < len; ++t) ASSERT_EQ(row[t], request.input_ids.data<int32_t>()[b * width + t]) << "prompt";
  for (int64_t t = len + steps; t < width + steps; ++t) ASSERT_EQ(row[t], -1) << "padding at " << t;
  const int64_t T = len + steps;
  std::vector<int32_t> ids(row, row + T), targets(static_cast<size_t>(T), -100);
  for (int64_t t = 0; t + 1 < T; ++t) targets[static_cast<size_t>(t)] = ids[static_cast<size_t>(t + 1)];
  const model::MicroBatch batch =
      model::MicroBatch::packed(Tensor::from_vector(ids, {T}), Tensor::from_vector(targets, {T}),
                                Tensor::from_vector<int32_t>({0, int32_t(T)}, {2}));
  const Tensor scored = PlainExecutor(model, nullptr).run_forward({batch})[0];
  for (int64_t n = 0; n < steps; ++n) {
    const float want = scored.data<float>()[len - 1 + n], got = out.logprobs.data<float>()[b * steps + n];
    EXPECT_EQ(std::memcmp(&want, &got, sizeof(float)), 0)
        << "step " << n << ": generate's log-prob " << got << ", score's " << want;
  }
  if (request.temperature == 0.0) {
    model::ForwardObservation observe;
    PlainExecutor(model, nullptr).run_forward({batch}, nullptr, &observe);
    const Tensor& logits = observe.logits[0];
    const int64_t vocab = logits.size(1);
    for (int64_t n = 0; n < steps; ++n) {
      const float* l = logits.data<float>() + (len - 1 + n) * vocab;
      EXPECT_EQ(row[len + n], pick_token(l, vocab, 0.0, 0.0)) << "step " << n << " is not the full forward's argmax";
    }
  }
}

void expect_generation_matches_score(model::CausalLm& model, bool exact, double temperature) {
  SCOPED_TRACE(std::string(exact ? "exact" : "plain") + " temperature " + std::to_string(temperature));
  model.set_exact(exact);
  const int64_t vocab = model.config().vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {
      {3, 17, 42, 5, 9}, {int32_t(vocab - 1)}, {11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21}};
  const GenerationRequest request = request_of(prompts, 12, temperature, 5);
  const Generation out = generate(model, request);
  ASSERT_EQ(out.tokens.shape(), (Shape{3, 11 + 12}));
  ASSERT_EQ(out.logprobs.shape(), (Shape{3, 12}));
  for (int64_t b = 0; b < 3; ++b) expect_row_matches_score(model, request, out, b);
  // Greedy, each row is its own: generated alone, a row gives the same tokens and bytes. (Sampling draws row b from
  // stream b, so a row alone, row 0, draws other numbers.)
  if (temperature == 0.0) {
    const Generation one = generate(model, request_of({prompts[2]}, 12, temperature, 5));
    EXPECT_EQ(std::memcmp(one.logprobs.data<float>(), out.logprobs.data<float>() + 2 * 12, 12 * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(one.tokens.data<int32_t>(), out.tokens.data<int32_t>() + 2 * 23, 23 * sizeof(int32_t)), 0);
  }
  model.set_exact(false);
}

TEST(Generation, TinyMoeDecodesWithItsCacheAsTheFullForwardScores) {
  std::unique_ptr<model::CausalLm> model = fixtures::make_model(fixtures::tiny_moe(), 21);
  for (const bool exact : {true, false}) {
    for (const double temperature : {0.0, 0.8}) expect_generation_matches_score(*model, exact, temperature);
  }
}

TEST(Generation, GptOssSinksAndSlidingWindowDecodeAsTheFullForwardScores) {
  // The golden config alternates a sliding window of 8 with full attention; prompts and generations run past 8.
  std::unique_ptr<model::CausalLm> model = golden_model("gpt_oss", 22);
  for (const bool exact : {true, false}) expect_generation_matches_score(*model, exact, 0.0);
  expect_generation_matches_score(*model, true, 1.3);
}

TEST(Generation, DeepSeekV2LatentAttentionDecodesAsTheFullForwardScores) {
  // The golden config: latent attention (q without LoRA, the decoupled rope key), shared experts, dense layer 0.
  model::ModelConfig config = model::load_model_config(testing::test_data_path("golden/deepseek_v2/config.json"));
  std::unique_ptr<model::CausalLm> model = fixtures::make_model(config, 27);
  for (const bool exact : {true, false}) expect_generation_matches_score(*model, exact, 0.0);
  expect_generation_matches_score(*model, true, 0.9);
}

TEST(Generation, SamplingIsSeededPerRow) {
  std::unique_ptr<model::CausalLm> model = fixtures::make_model(fixtures::tiny_moe(), 23);
  const GenerationRequest a = request_of({{1, 2, 3}, {4, 5}}, 8, 1.0, 99);
  const Generation first = generate(*model, a), again = generate(*model, a);
  EXPECT_EQ(std::memcmp(first.tokens.raw_data(), again.tokens.raw_data(), first.tokens.nbytes()), 0);
  GenerationRequest other_seed = a;
  other_seed.seed = 100;
  const Generation other = generate(*model, other_seed);
  EXPECT_NE(std::memcmp(first.tokens.raw_data(), other.tokens.raw_data(), first.tokens.nbytes()), 0)
      << "seeds 99 and 100 sampled the same 16 tokens from a 257-token vocabulary";
}

TEST(Generation, PickTokenIsTheFirstMaximumOrAnInverseTransformDraw) {
  const std::vector<float> tie{1.0f, 3.0f, 3.0f, -2.0f};
  EXPECT_EQ(pick_token(tie.data(), 4, 0.0, 0.0), 1);
  // softmax({0, log 3}) = {1/4, 3/4}: draws below 1/4 pick token 0.
  const std::vector<float> two{0.0f, std::log(3.0f)};
  EXPECT_EQ(pick_token(two.data(), 2, 1.0, 0.2), 0);
  EXPECT_EQ(pick_token(two.data(), 2, 1.0, 0.3), 1);
  EXPECT_EQ(pick_token(two.data(), 2, 1.0, 0.999), 1);
  // A low temperature sharpens towards the maximum.
  EXPECT_EQ(pick_token(two.data(), 2, 0.01, 0.2), 1);
  const std::vector<float> bad{0.0f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THROW(pick_token(bad.data(), 2, 0.0, 0.0), Error);
}

void expect_refused(const model::CausalLm& model, const GenerationRequest& request, const std::string& needle) {
  try {
    generate(model, request);
    ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Generation, BadRequestsAreRefusedByName) {
  std::unique_ptr<model::CausalLm> model = fixtures::make_model(fixtures::tiny_moe(), 24);
  const GenerationRequest good = request_of({{1, 2, 3}, {4, 5}}, 4, 0.0, 0);
  GenerationRequest r = good;
  r.lengths = {3};
  expect_refused(*model, r, "expected 2 prompt lengths (one per row of input_ids) but found 1");
  r = good;
  r.lengths = {3, 0};
  expect_refused(*model, r, "lengths[1] = 0 must be in [1, P = 3]");
  r = good;
  r.lengths = {4, 2};
  expect_refused(*model, r, "lengths[0] = 4 must be in [1, P = 3]");
  r = good;
  r.input_ids.data<int32_t>()[4] = 257;
  expect_refused(*model, r, "input_ids[1, 1] = 257 is outside the vocabulary [0, 257)");
  r = request_of({{1, 2, 3}, {4, 5}}, 4, 0.0, 0);
  r.max_new_tokens = 0;
  expect_refused(*model, r, "max_new_tokens must be >= 1 but is 0");
  r.max_new_tokens = 4;
  r.temperature = -0.5;
  expect_refused(*model, r, "temperature must be finite and >= 0 (0: greedy) but is -0.5");
  r.temperature = std::numeric_limits<double>::quiet_NaN();
  expect_refused(*model, r, "temperature must be finite and >= 0");
  r.temperature = 0.0;
  r.input_ids = r.input_ids.to(DType::I64);
  expect_refused(*model, r, "input_ids must be a contiguous int32 [B, P] tensor on the CPU");
}

TEST(Generation, Qwen3_5GatedDeltaNetDecodesAsTheFullForwardScores) {
  // Qwen3.5-MoE's golden config: Gated DeltaNet layers (the conv over each sequence's inputs, the recurrent state per
  // value head) beside gated full attention with partial rope, and the shared expert; the dense Qwen3.5 too.
  for (const std::string family : {"qwen3_5_moe", "qwen3_5"}) {
    SCOPED_TRACE(family);
    std::unique_ptr<model::CausalLm> model = golden_model(family, 26);
    for (const bool exact : {true, false}) expect_generation_matches_score(*model, exact, 0.0);
    expect_generation_matches_score(*model, true, 0.9);
  }
}

TEST(Generation, TheDecodeCacheRefusesStepsOutOfOrderOrPastItsCapacity) {
  model::DecodeCache cache(2, 4);
  EXPECT_THROW(cache.begin_step(), Error);
  EXPECT_THROW(cache.begin_prefill({1}), Error);
  EXPECT_THROW(cache.begin_prefill({1, 5}), Error);
  cache.begin_prefill({3, 1});
  cache.begin_step();
  EXPECT_EQ(cache.lengths().to_vector<int32_t>(), (std::vector<int32_t>{4, 2}));
  try {
    cache.begin_step();
    ADD_FAILURE() << "a step past the capacity was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 0 already holds 4 tokens, the capacity"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(cache.lengths().to_vector<int32_t>(), (std::vector<int32_t>{4, 2})) << "a refused step changed lengths";
}

}  // namespace
}  // namespace moetrain::pipeline
