// Tests of exact mode on one GPU (docs/exact_lanes.md): the CPU's byte gates (tests/cli/score_command_test.cpp,
// tests/cli/generate_command_test.cpp) on CUDA with bf16 compute and the batch-invariant kernels, for every family
// (the tiny example and each golden model, widened to 8 layers, and Qwen3-MoE at head dim 64 for the tensor-core
// attention; random weights, a head chunk narrower than the vocabulary): packed documents give the bytes of each
// document alone, padding leaves them, the training forward's log-probs are score's, generate's log-probs are score's,
// and the score file is byte-identical for pp in {1, 2, 4} x ep in {1, 2} on thread ranks sharing the GPU.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/generate_command.h"
#include "cli/score_command.h"
#include "io/job_config.h"
#include "io/safetensors.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "ops/loss.h"
#include "pipeline/plain_executor.h"
#include "testing/exact_scoring.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::cli {
namespace {

namespace fs = std::filesystem;
using testing::expect_same_float_bytes;
using testing::i32_vector;
using testing::score_input;
using testing::score_tokens;

constexpr int kLayers = 8;  // pp = 4 runs 8 stages of one layer

struct Family {
  std::string name;
  std::string config;  // config.json path
};

// The golden model's config with kLayers decoder layers (a per-layer list repeats its pattern) and, when given, another
// head dim, written to `dir`.
std::string widened_config(const std::string& family, const std::string& dir, int head_dim = 0) {
  nlohmann::json config =
      nlohmann::json::parse(std::ifstream(testing::test_data_path("golden/" + family + "/config.json")));
  nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  text["num_hidden_layers"] = kLayers;
  if (head_dim > 0) text["head_dim"] = head_dim;
  if (text.contains("layer_types")) {
    const nlohmann::json pattern = text["layer_types"];
    nlohmann::json types = nlohmann::json::array();
    for (int l = 0; l < kLayers; ++l) types.push_back(pattern[static_cast<size_t>(l) % pattern.size()]);
    text["layer_types"] = types;
  }
  const std::string path = dir + "/config.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

std::vector<Family> families() {
  const std::string dir = testing::make_temp_dir("exact_families");
  std::vector<Family> out = {{"tiny_moe", testing::repo_path("examples/tiny_moe/config.json")}};
  for (const std::string name : {"qwen3", "qwen3_moe", "deepseek_v2", "gpt_oss", "qwen3_5", "qwen3_5_moe"}) {
    fs::create_directories(dir + "/" + name);
    out.push_back({name, widened_config(name, dir + "/" + name)});
  }
  // Head dim 64: attention on the tensor-core kernels (ops/cuda/attention_mma.h), the golden models' 16 and 32 on the
  // CUDA-core ones.
  fs::create_directories(dir + "/qwen3_moe_hd64");
  out.push_back({"qwen3_moe_hd64", widened_config("qwen3_moe", dir + "/qwen3_moe_hd64", 64)});
  return out;
}

// A job on `config` on the GPU: bf16 compute, random weights (seed 1234), micro-batches of 2 rows, a head chunk of
// 128 columns (every vocabulary here is wider), exact mode.
std::string write_job(const std::string& dir, const std::string& config) {
  const std::string path = dir + "/job.toml";
  std::ofstream(path) << "[model]\nconfig = \"" << config
                      << "\"\ninit = \"random\"\ndevice = \"cuda\"\ncompute_dtype = \"bf16\"\nhead_chunk = 128\n"
                         "[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 32\nmicro_batch = 2\n"
                         "seed = 1234\n[exact]\nenabled = true\n";
  return path;
}

std::unique_ptr<model::CausalLm> exact_model(const std::string& job_path) {
  const io::JobConfig job = io::load_job_config(job_path, {});
  auto model = load_model_for_job(job);
  model->set_exact(true);
  return model;
}

void expect_packed_documents_are_their_bytes_alone(model::CausalLm& model) {
  // Two rows of 24 tokens: row 0 packs documents of 7, 10 and 7 tokens, row 1 of 5 and 19.
  const std::vector<int32_t> ids = score_tokens(48, 1);
  const std::vector<int32_t> cu = {0, 7, 17, 24, 29, 48};
  const Tensor packed = score_logprobs(model, score_input(ids, 2, cu), 2, true);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t begin = cu[d], end = cu[d + 1], len = end - begin;
    const std::vector<int32_t> alone_ids(ids.begin() + begin, ids.begin() + end);
    const Tensor alone = score_logprobs(model, score_input(alone_ids, 1), 1, true);
    expect_same_float_bytes(packed, (begin / 24) * 23 + begin % 24, alone, 0, len - 1,
                            "document " + std::to_string(d) + " packed against alone");
  }
}

void expect_padding_leaves_the_bytes(model::CausalLm& model) {
  const std::vector<int32_t> real = score_tokens(16, 2);
  const Tensor alone = score_logprobs(model, score_input(real, 1), 1, true);
  std::vector<int32_t> rows = score_tokens(16, 3);
  rows.insert(rows.end(), real.begin(), real.end());
  const std::vector<int32_t> after = score_tokens(32, 4);
  rows.insert(rows.end(), after.begin(), after.end());
  for (const int64_t micro : {2, 3}) {
    const Tensor padded = score_logprobs(model, score_input(rows, 4), micro, true);
    expect_same_float_bytes(padded, 15, alone, 0, 15, "padding rows, micro-batch " + std::to_string(micro));
  }
  std::vector<int32_t> longer = real;
  const std::vector<int32_t> pad = score_tokens(8, 5);
  longer.insert(longer.end(), pad.begin(), pad.end());
  const Tensor padded = score_logprobs(model, score_input(longer, 1, {0, 16, 24}), 1, true);
  expect_same_float_bytes(padded, 0, alone, 0, 15, "a padding document");
}

void expect_training_logprobs_are_score_bytes(model::CausalLm& model) {
  const std::vector<int32_t> ids = score_tokens(64, 6);
  const std::vector<int32_t> cu = {0, 11, 32, 45, 64};
  const Tensor scored = score_logprobs(model, score_input(ids, 2, cu), 2, true);
  std::vector<int32_t> targets(ids.size(), ops::kIgnoreIndex);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int32_t t = cu[d]; t + 1 < cu[d + 1]; ++t) targets[static_cast<size_t>(t)] = ids[static_cast<size_t>(t + 1)];
  }
  const model::MicroBatch batch =
      model::MicroBatch::packed(Tensor::from_vector(ids, {64}), Tensor::from_vector(targets, {64}), i32_vector(cu));
  // The log-probs of the head training runs (the job's fused head), not of materialised logits kept for inspection.
  model::ForwardObservation observe;
  observe.keep_logits = false;
  model.params().zero_grads();
  pipeline::forward_backward(model, {batch}, 0, &observe);  // moves the host batch to the model's device
  ASSERT_EQ(observe.token_logprobs.size(), 1u);
  const Tensor trained = observe.token_logprobs[0].to(Device::cpu());
  for (int64_t r = 0; r < 2; ++r) {
    expect_same_float_bytes(scored, r * 31, trained, r * 32, 31, "training forward, row " + std::to_string(r));
  }
}

TEST(CudaExact, PackingPaddingAndTrainingGiveScoresBytesForEveryFamily) {
  MT_REQUIRE_GPU();
  for (const Family& family : families()) {
    SCOPED_TRACE(family.name);
    const std::string dir = testing::make_temp_dir("cuda_exact_" + family.name);
    const auto model = exact_model(write_job(dir, family.config));
    expect_packed_documents_are_their_bytes_alone(*model);
    expect_padding_leaves_the_bytes(*model);
    expect_training_logprobs_are_score_bytes(*model);
  }
}

TEST(CudaExact, GenerateLogprobsAreTheBytesScoreWritesForEveryFamily) {
  MT_REQUIRE_GPU();
  for (const Family& family : families()) {
    SCOPED_TRACE(family.name);
    const std::string dir = testing::make_temp_dir("cuda_generate_" + family.name);
    GenerateOptions options;
    options.config_path = write_job(dir, family.config);
    options.input = dir + "/prompts.safetensors";
    options.out = dir + "/generated.safetensors";
    options.max_new_tokens = 9;
    options.temperature = 0.7;
    options.seed = 3;
    // Two prompts of 6 and 3 tokens in rows of 6; 70 new tokens for the first take it past one attention tile.
    io::write_safetensors(
        options.input,
        {{"input_ids", Tensor::from_vector<int32_t>({5, 9, 200, 31, 7, 64, 12, 13, 14, 0, 0, 0}, {2, 6})},
         {"lengths", Tensor::from_vector<int32_t>({6, 3}, {2})}});
    for (const int64_t new_tokens : {int64_t{9}, int64_t{70}}) {
      options.max_new_tokens = new_tokens;
      ASSERT_EQ(run_generate(options), 0);
      const io::SafetensorsFile generated = io::SafetensorsFile::open(options.out);
      const Tensor tokens = generated.tensor("tokens").clone(), logprobs = generated.tensor("logprobs").clone();
      const int64_t width = 6 + new_tokens;
      for (int64_t b = 0; b < 2; ++b) {
        const int64_t length = b == 0 ? 6 : 3, T = length + new_tokens;
        std::vector<int32_t> row(tokens.data<int32_t>() + b * width, tokens.data<int32_t>() + b * width + T);
        ScoreOptions score;
        score.config_path = options.config_path;
        score.input = dir + "/score_in.safetensors";
        score.out = dir + "/score_out.safetensors";
        io::write_safetensors(score.input, {{"input_ids", Tensor::from_vector(row, {1, T})}});
        ASSERT_EQ(run_score(score), 0);
        const Tensor scored = io::SafetensorsFile::open(score.out).tensor("logprobs").clone();
        expect_same_float_bytes(
            scored, length - 1, logprobs, b * new_tokens, new_tokens,
            fmt::format("row {} of {} new tokens: generate's log-probs against score's", b, new_tokens));
      }
    }
  }
}

// The layouts of tests/cli/score_command_test.cpp's gate, on thread ranks sharing the GPU.
TEST(CudaExact, ScoreFileIsByteIdenticalForEveryPipelineAndExpertLayoutOnOneGpu) {
  MT_REQUIRE_GPU();
  for (const Family& family : families()) {
    SCOPED_TRACE(family.name);
    const std::string dir = testing::make_temp_dir("cuda_layouts_" + family.name);
    write_job(dir, family.config);
    const std::string input = testing::write_layout_input(dir);
    const std::string reference = testing::read_file_bytes(testing::score_on_layout(dir, input, {1, 1, 1}, {}));
    ASSERT_FALSE(reference.empty());
    // ep 2 on a dense model (qwen3, qwen3_5) spreads no experts: its ep ranks run as data ranks do.
    const std::vector<testing::Layout> layouts = {{2, 1, 1}, {4, 1, 1}, {1, 1, 2}, {1, 2, 1}, {2, 2, 1}, {4, 2, 1}};
    for (const testing::Layout& layout : layouts) {
      const std::string bytes = testing::read_file_bytes(testing::score_on_layout(dir, input, layout, {}));
      EXPECT_TRUE(bytes == reference) << layout.name() << ": the score file differs from pp 1 x ep 1 x dp 1";
    }
  }
}

}  // namespace
}  // namespace moetrain::cli
