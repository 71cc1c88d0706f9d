// Tests that every layout runs one program when the vocabulary spans several head chunks (model.head_chunk): the
// tiny MoE example with a 1,000-token vocabulary and 256-column chunks (three full chunks and one of 232), trained
// on thread ranks (f32, CPU, synthetic data, router losses on, clipping active). pp = 2 and 4 train like one rank bit
// for bit; ep = 2 like one rank within the fp32 summation-order tolerance, and pp = 2 x ep = 2 like ep = 2 bit for
// bit; in exact mode the training forward's log-probs are score's bytes, and score's output file is the same bytes
// for pp in {1, 2, 4} x ep in {1, 2}. Before the layer driver was shared, the executors materialised the logits
// while the single-rank path chunked them, so these layouts gave other bits.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/score_command.h"
#include "io/job_config.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "pipeline/plain_executor.h"
#include "testing/layout_runs.h"
#include "testing/test_data.h"
#include "train/trainer.h"

namespace moetrain::train {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 1000;
constexpr int64_t kHeadChunk = 256;
constexpr int64_t kSteps = 3;

// The tiny example's config.json with a vocabulary four head chunks wide, in a folder of its own.
std::string wide_config_path() {
  static const std::string path = [] {
    const std::string dir = testing::make_temp_dir("wide_vocabulary");
    std::ifstream in(testing::repo_path("examples/tiny_moe/config.json"));
    nlohmann::json config = nlohmann::json::parse(in);
    config["vocab_size"] = kVocab;
    std::ofstream(dir + "/config.json") << config.dump(2);
    return dir + "/config.json";
  }();
  return path;
}

io::JobConfig job() {
  io::JobConfig c;
  c.model.config = wide_config_path();
  c.model.init = "random";
  c.model.head_chunk = kHeadChunk;
  c.data.mode = "synthetic";
  c.train.steps = kSteps;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 16;  // 8 micro-batches: 2P for pp = 4
  c.optim.lr = 1e-3;
  c.optim.clip_grad_norm = 0.5;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.parallel.sharding = "none";
  c.metrics.console_every = 0;
  return c;
}

using testing::expect_bitwise;
using testing::expect_close;
using testing::LayoutRun;

LayoutRun run_single(const io::JobConfig& config) { return testing::run_one_rank(config); }
LayoutRun run_mesh(const io::JobConfig& config, int pp, int ep) { return testing::run_layout(config, pp, ep); }

const LayoutRun& one_rank() {
  static const LayoutRun run = run_single(job());
  return run;
}

TEST(WideVocabulary, TheChunkedHeadIsAnotherProgramThanMaterialisedLogits) {
  // What the layout tests below rely on: with the vocabulary in four chunks the fused head's bits differ from the
  // materialised head's, so a layout that took the other head would show.
  io::JobConfig materialised = job();
  materialised.model.head_chunk = 0;
  const LayoutRun other = run_single(materialised);
  EXPECT_NE(other.losses, one_rank().losses);
  for (size_t s = 0; s < one_rank().grad_norms.size(); ++s)
    EXPECT_GT(one_rank().grad_norms[s], job().optim.clip_grad_norm) << "step " << s + 1 << " should clip";
}

TEST(WideVocabulary, PipelineLayoutsTrainLikeOneRankBitwise) {
  expect_bitwise(run_mesh(job(), 2, 1), one_rank(), "pp=2");
  expect_bitwise(run_mesh(job(), 4, 1), one_rank(), "pp=4");
}

TEST(WideVocabulary, ExpertParallelLayoutsTrainAlike) {
  const LayoutRun ep2 = run_mesh(job(), 1, 2);
  expect_close(ep2, one_rank(), "ep=2 against one rank");
  expect_bitwise(run_mesh(job(), 2, 2), ep2, "pp=2 x ep=2 against ep=2");
}

std::vector<int32_t> tokens(int64_t n, uint64_t salt) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * i * 13 + i * 5 + salt * 71 + 3) % kVocab);
  return ids;
}

std::string job_file(const std::string& dir) {
  const std::string path = dir + "/job.toml";
  std::ofstream(path) << "[model]\nconfig = \"" << wide_config_path()
                      << "\"\ninit = \"random\"\nhead_chunk = " << kHeadChunk
                      << "\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 32\nmicro_batch = 2\n"
                         "seed = 1234\n";
  return path;
}

TEST(WideVocabulary, ExactTrainingLogprobsAreScoreBytes) {
  const std::string dir = testing::make_temp_dir("wide_vocabulary_exact");
  const io::JobConfig config = io::load_job_config(job_file(dir), {"exact.enabled=true"});
  auto model = cli::load_model_for_job(config);
  ASSERT_EQ(model->head_chunk(), kHeadChunk) << "score builds the job's head";
  model->set_exact(true);

  const std::vector<int32_t> ids = tokens(64, 6);
  const std::vector<int32_t> cu = {0, 11, 32, 45, 64};
  cli::ScoreInput input;
  input.input_ids = Tensor::from_vector(ids, {2, 32});
  input.cu_seqlens = Tensor::from_vector(cu, {5});
  const Tensor scored = cli::score_logprobs(*model, input, 2, true);

  // The training forward (and backward) on the same tokens, packed as the loader packs them.
  const model::MicroBatch batch = cli::score_micro_batch(input, 0, 2);
  model::ForwardObservation observe;
  observe.keep_logits = false;  // the job's own head: the logits are never whole
  model->params().zero_grads();
  pipeline::forward_backward(*model, {batch}, 0, &observe);
  ASSERT_EQ(observe.token_logprobs.size(), 1u);
  const Tensor& trained = observe.token_logprobs[0];
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(std::memcmp(scored.data<float>() + r * 31, trained.data<float>() + r * 32, 31 * sizeof(float)), 0)
        << "row " << r;
  }
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(WideVocabulary, ExactScoreFileIsTheSameBytesOnEveryLayout) {
  const std::string dir = testing::make_temp_dir("wide_vocabulary_layouts");
  const std::string job_path = job_file(dir);
  const std::string input = dir + "/in.safetensors";
  io::write_safetensors(input, {{"input_ids", Tensor::from_vector(tokens(4 * 20, 11), {4, 20})},
                                {"cu_seqlens", Tensor::from_vector<int32_t>({0, 7, 20, 33, 40, 60, 71, 80}, {8})}});
  std::string reference;
  for (const auto& [pp, ep] : std::vector<std::pair<int, int>>{{1, 1}, {1, 2}, {2, 1}, {2, 2}, {4, 1}}) {
    cli::ScoreOptions options;
    options.config_path = job_path;
    options.input = input;
    options.out = dir + "/out_" + std::to_string(pp) + "_" + std::to_string(ep) + ".safetensors";
    options.overrides = {"exact.enabled=true", "parallel.pp=" + std::to_string(pp),
                         "parallel.ep=" + std::to_string(ep)};
    if (pp * ep > 1) options.overrides.push_back("dist.local_ranks=" + std::to_string(pp * ep));
    ASSERT_EQ(cli::run_score(options), 0) << "pp " << pp << " x ep " << ep;
    const std::string bytes = read_bytes(options.out);
    if (reference.empty()) {
      reference = bytes;
      ASSERT_FALSE(reference.empty());
    }
    EXPECT_TRUE(bytes == reference) << "pp " << pp << " x ep " << ep << ": the score file differs from one process";
  }
}

}  // namespace
}  // namespace moetrain::train
