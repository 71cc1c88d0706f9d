// Tests of `moetrain generate` (cli/generate_command.h) end to end on the tiny example: in exact mode, the log-probs
// generate writes are the bytes `moetrain score` writes for the generated sequences (K3 = 0 in one engine), and every
// malformed input file, flag or job is refused before anything is written.
#include "cli/generate_command.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cli/score_command.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "testing/test_data.h"

namespace moetrain::cli {
namespace {

namespace fs = std::filesystem;

std::string write_job(const std::string& dir) {
  const std::string config =
      testing::repo_path("examples/tiny_moe/config.json");
  const std::string path = dir + "/job.toml";
  std::ofstream(path) << "[model]\nconfig = \"" << config
                      << "\"\ninit = \"random\"\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 32\n"
                         "micro_batch = 1\nseed = 1234\n";
  return path;
}

GenerateOptions options_in(const std::string& dir, std::vector<std::string> overrides = {"exact.enabled=true"}) {
  GenerateOptions options;
  options.config_path = write_job(dir);
  options.input = dir + "/prompts.safetensors";
  options.out = dir + "/generated.safetensors";
  options.max_new_tokens = 9;
  options.temperature = 0.7;
  options.seed = 3;
  options.overrides = std::move(overrides);
  return options;
}

TEST(GenerateCommand, ExactLogprobsAreTheBytesScoreWritesForTheGeneratedSequences) {
  const std::string dir = testing::make_temp_dir("generate_exact");
  const GenerateOptions options = options_in(dir);
  // Two prompts of 6 and 3 tokens in rows of 6 (the second row's tail is ignored).
  io::write_safetensors(
      options.input, {{"input_ids", Tensor::from_vector<int32_t>({5, 9, 200, 31, 7, 64, 12, 13, 14, 0, 0, 0}, {2, 6})},
                      {"lengths", Tensor::from_vector<int32_t>({6, 3}, {2})}});
  ASSERT_EQ(run_generate(options), 0);
  const io::SafetensorsFile generated = io::SafetensorsFile::open(options.out);
  const Tensor tokens = generated.tensor("tokens").clone(), logprobs = generated.tensor("logprobs").clone();
  ASSERT_EQ(tokens.shape(), (Shape{2, 15}));
  ASSERT_EQ(logprobs.shape(), (Shape{2, 9}));
  const std::vector<int32_t> lengths{6, 3};
  for (int64_t b = 0; b < 2; ++b) {
    SCOPED_TRACE("row " + std::to_string(b));
    const int64_t T = lengths[b] + 9;
    std::vector<int32_t> row(tokens.data<int32_t>() + b * 15, tokens.data<int32_t>() + b * 15 + T);
    for (int64_t t = T; t < 15; ++t) EXPECT_EQ(tokens.data<int32_t>()[b * 15 + t], -1);
    ScoreOptions score;
    score.config_path = options.config_path;
    score.input = dir + "/score_in" + std::to_string(b) + ".safetensors";
    score.out = dir + "/score_out" + std::to_string(b) + ".safetensors";
    score.overrides = {"exact.enabled=true"};
    io::write_safetensors(score.input, {{"input_ids", Tensor::from_vector(row, {1, T})}});
    ASSERT_EQ(run_score(score), 0);
    const Tensor scored = io::SafetensorsFile::open(score.out).tensor("logprobs").clone();
    EXPECT_EQ(std::memcmp(scored.data<float>() + lengths[b] - 1, logprobs.data<float>() + b * 9, 9 * sizeof(float)), 0)
        << "generate's log-probs are not score's bytes";
  }
}

void expect_refused(const std::string& tag, const std::vector<std::pair<std::string, Tensor>>& tensors,
                    std::initializer_list<std::string> needles, GenerateOptions options) {
  io::write_safetensors(options.input, tensors);
  try {
    run_generate(options);
    ADD_FAILURE() << tag << ": expected an error holding '" << *needles.begin() << "'";
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << tag << ": " << e.what();
  }
  EXPECT_FALSE(fs::exists(options.out)) << tag;
  EXPECT_FALSE(fs::exists(options.out + ".tmp")) << tag;
}

TEST(GenerateCommand, MalformedInputsFlagsAndJobsAreRefusedBeforeAnythingIsWritten) {
  const std::string dir = testing::make_temp_dir("generate_refuse");
  const GenerateOptions good = options_in(dir);
  const Tensor ids = Tensor::from_vector<int32_t>({1, 2, 3, 4}, {2, 2});
  expect_refused("no input_ids", {{"lengths", Tensor::from_vector<int32_t>({1, 1}, {2})}},
                 {"no tensor 'input_ids' (expected int32 [B, P] prompt tokens)"}, good);
  expect_refused("extra tensor", {{"input_ids", ids}, {"labels", ids}}, {"unexpected tensor 'labels'"}, good);
  expect_refused("1-D ids", {{"input_ids", Tensor::from_vector<int32_t>({1, 2}, {2})}},
                 {"'input_ids' must be int32 [B, P] with B >= 1 and P >= 1 but is"}, good);
  expect_refused("f32 ids", {{"input_ids", Tensor::zeros({2, 2}, DType::F32)}}, {"'input_ids' must be int32 [B, P]"},
                 good);
  expect_refused("lengths shape", {{"input_ids", ids}, {"lengths", Tensor::from_vector<int32_t>({1}, {1})}},
                 {"'lengths' must be int32 [B] with B = 2"}, good);
  expect_refused("length 0", {{"input_ids", ids}, {"lengths", Tensor::from_vector<int32_t>({0, 2}, {2})}},
                 {"lengths[0] = 0 must be in [1, P = 2]"}, good);
  expect_refused("token outside", {{"input_ids", Tensor::from_vector<int32_t>({1, 257, 3, 4}, {2, 2})}},
                 {"input_ids[0, 1] = 257 is outside the vocabulary [0, 257)"}, good);
  GenerateOptions flags = good;
  flags.max_new_tokens = 0;
  expect_refused("no new tokens", {{"input_ids", ids}}, {"max_new_tokens must be >= 1 but is 0"}, flags);
  flags = good;
  flags.temperature = -1.0;
  expect_refused("negative temperature", {{"input_ids", ids}}, {"temperature must be finite and >= 0"}, flags);
  expect_refused("pp 2", {{"input_ids", ids}}, {"generate: runs on one rank", "pp 2"},
                 options_in(dir, {"parallel.pp=2"}));
  GenerateOptions onto_input = good;
  onto_input.out = good.input;
  try {
    io::write_safetensors(onto_input.input, {{"input_ids", ids}});
    run_generate(onto_input);
    ADD_FAILURE() << "--out onto the input was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is the input file"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(io::SafetensorsFile::open(onto_input.input).contains("input_ids")) << "the input was overwritten";
}

}  // namespace
}  // namespace moetrain::cli
