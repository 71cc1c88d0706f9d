// Tests that the MoE families beyond Qwen3 train and score alike on every layout (thread ranks, f32 on the CPU,
// synthetic data, router losses on, clipping active), each on its golden config grown so that every part of the
// family runs:
// - DeepSeek-V2: 8 layers with a q LoRA, group-limited top-k (4 groups, 2 kept) and a routed scaling factor;
// - GPT-OSS: 8 layers alternating a sliding window of 8 (shorter than the rows) and full attention, with its biases,
//   sinks, YaRN, biased top-k-then-softmax router and clamped SwiGLU experts;
// - Qwen3.5-MoE: 8 layers, three Gated DeltaNet to one gated full attention, with the shared expert's sigmoid gate.
// pp = 2 and 4 train like one rank bit for bit; ep = 2 within the fp32 summation-order tolerance, pp = 2 x ep = 2
// like ep = 2 bit for bit, ZeRO-3 over two data ranks within the tolerance; in exact mode score's output file is the
// same bytes for pp in {1, 2, 4} x ep in {1, 2}, and a packed row gives its documents' bytes.
#include <cstring>
#include <fstream>
#include <iterator>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/score_command.h"
#include "io/job_config.h"
#include "io/json_fields.h"
#include "io/safetensors.h"
#include "model/family.h"
#include "model/model_config.h"
#include "model/parameter_store.h"
#include "testing/layout_runs.h"
#include "testing/test_data.h"

namespace moetrain::train {
namespace {

using testing::expect_bitwise;
using testing::expect_close;
using testing::LayoutRun;

// The family's golden config.json, grown as the header says; written once per family.
std::string config_path(const std::string& family) {
  static std::map<std::string, std::string> paths;
  if (auto it = paths.find(family); it != paths.end()) return it->second;
  const std::string dir = testing::make_temp_dir(family + "_layouts");
  nlohmann::json config = io::read_json_object(testing::test_data_path("golden/" + family + "/config.json"));
  config["num_hidden_layers"] = 8;
  if (family == "deepseek_v2") {
    config["q_lora_rank"] = 24;
    config["topk_method"] = "group_limited_greedy";
    config["n_group"] = 4;
    config["topk_group"] = 2;
    config["routed_scaling_factor"] = 2.5;
  } else if (family == "gpt_oss") {
    config["layer_types"] = nlohmann::json::array();
    for (int layer = 0; layer < 8; ++layer)
      config["layer_types"].push_back(layer % 2 == 0 ? "sliding_attention" : "full_attention");
  } else {  // qwen3_5_moe: three Gated DeltaNet layers to one of full attention, as released
    config["layer_types"] = nlohmann::json::array();
    for (int layer = 0; layer < 8; ++layer)
      config["layer_types"].push_back(layer % 4 == 3 ? "full_attention" : "linear_attention");
  }
  std::ofstream(dir + "/config.json") << config.dump(2);
  return paths[family] = dir + "/config.json";
}

io::JobConfig family_job(const std::string& family) {
  io::JobConfig c;
  c.model.config = config_path(family);
  c.model.init = "random";
  c.data.mode = "synthetic";
  c.train.steps = 3;
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

// The tolerance of a parameter after the run's Adam steps, relative to its norm. Most start from the random init and
// move by a few lr-sized steps, so fp32 summation order leaves them within 1e-5. A parameter initialised to zero (GPT-OSS's
// attention and expert biases) is made of the Adam updates alone, and Adam divides each element's moment by its own
// scale: an element whose gradients nearly cancel over the steps gets an update as sensitive to rounding as its
// small moment is (one expert-bias element moved 3.44e-5 in one run and 3.38e-5 in the other), and such elements are
// not outweighed by an init. 1e-4 for those (measured: 1.7e-5 and 2.9e-5 at ep = 2); a wrong gradient is O(1).
std::function<double(const std::string&)> param_tolerance(const std::string& family) {
  std::set<std::string> zero_init;
  const model::ModelConfig config = model::load_model_config(config_path(family));
  for (const model::ParamSpec& spec : config.family->param_specs(config))
    if (spec.init == model::ParamInit::Zeros) zero_init.insert(spec.name);
  return [zero_init](const std::string& name) { return zero_init.count(name) ? 1e-4 : 1e-5; };
}

class FamilyLayouts : public ::testing::TestWithParam<const char*> {
 protected:
  std::string family() const { return GetParam(); }
  io::JobConfig job() const { return family_job(family()); }
  const LayoutRun& one_rank() const {
    static std::map<std::string, LayoutRun> runs;
    if (!runs.count(family())) runs.emplace(family(), testing::run_one_rank(job()));
    return runs.at(family());
  }
};

TEST_P(FamilyLayouts, PipelineTrainsLikeOneRankBitwise) {
  for (size_t s = 0; s < one_rank().grad_norms.size(); ++s)
    EXPECT_GT(one_rank().grad_norms[s], job().optim.clip_grad_norm) << "step " << s + 1 << " should clip";
  expect_bitwise(testing::run_layout(job(), 2, 1), one_rank(), "pp=2");
  expect_bitwise(testing::run_layout(job(), 4, 1), one_rank(), "pp=4");
}

TEST_P(FamilyLayouts, ExpertAndDataParallelTrainAlike) {
  const LayoutRun ep2 = testing::run_layout(job(), 1, 2);
  expect_close(ep2, one_rank(), "ep=2 against one rank", param_tolerance(family()));
  expect_bitwise(testing::run_layout(job(), 2, 2), ep2, "pp=2 x ep=2 against ep=2");
  io::JobConfig sharded = job();
  sharded.parallel.sharding = "full";
  expect_close(testing::run_layout(sharded, 1, 1, 2), one_rank(), "ZeRO-3 over dp=2 against one rank",
               param_tolerance(family()));
}

std::vector<int32_t> tokens(int64_t n, uint64_t salt, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * i * 13 + i * 5 + salt * 71 + 3) % vocab);
  return ids;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string job_file(const std::string& dir, const std::string& family) {
  const std::string path = dir + "/job.toml";
  std::ofstream(path) << "[model]\nconfig = \"" << config_path(family)
                      << "\"\ninit = \"random\"\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 32\n"
                         "micro_batch = 2\nseed = 1234\n";
  return path;
}

std::string score(const std::string& dir, const std::string& input, int pp, int ep) {
  cli::ScoreOptions options;
  options.config_path = dir + "/job.toml";
  options.input = input;
  options.out = dir + "/out_" + std::to_string(pp) + "_" + std::to_string(ep) + ".safetensors";
  options.overrides = {"exact.enabled=true", "parallel.pp=" + std::to_string(pp), "parallel.ep=" + std::to_string(ep)};
  if (pp * ep > 1) options.overrides.push_back("dist.local_ranks=" + std::to_string(pp * ep));
  EXPECT_EQ(cli::run_score(options), 0) << "pp " << pp << " x ep " << ep;
  return options.out;
}

TEST_P(FamilyLayouts, ExactScoreFileIsTheSameBytesOnEveryLayout) {
  const std::string dir = testing::make_temp_dir(family() + "_exact_layouts");
  job_file(dir, family());
  const std::string input = dir + "/in.safetensors";
  io::write_safetensors(input, {{"input_ids", Tensor::from_vector(tokens(4 * 20, 11, 512), {4, 20})},
                                {"cu_seqlens", Tensor::from_vector<int32_t>({0, 7, 20, 33, 40, 60, 71, 80}, {8})}});
  const std::string reference = read_bytes(score(dir, input, 1, 1));
  ASSERT_FALSE(reference.empty());
  for (const auto& [pp, ep] : std::vector<std::pair<int, int>>{{1, 2}, {2, 1}, {2, 2}, {4, 1}, {4, 2}})
    EXPECT_TRUE(read_bytes(score(dir, input, pp, ep)) == reference)
        << "pp " << pp << " x ep " << ep << ": the score file differs from one process";
}

TEST_P(FamilyLayouts, ExactPackedRowGivesEachDocumentsBytes) {
  const std::string dir = testing::make_temp_dir(family() + "_exact_packed");
  const io::JobConfig config = io::load_job_config(job_file(dir, family()), {"exact.enabled=true"});
  auto model = cli::load_model_for_job(config);
  model->set_exact(true);
  const std::vector<int32_t> ids = tokens(32, 6, 512);
  cli::ScoreInput packed;
  packed.input_ids = Tensor::from_vector(ids, {1, 32});
  packed.cu_seqlens = Tensor::from_vector<int32_t>({0, 13, 32}, {3});
  const Tensor together = cli::score_logprobs(*model, packed, 1, true);
  const std::vector<std::pair<int32_t, int32_t>> docs = {{0, 13}, {13, 32}};
  for (const auto& [begin, end] : docs) {
    cli::ScoreInput alone;
    alone.input_ids =
        Tensor::from_vector(std::vector<int32_t>(ids.begin() + begin, ids.begin() + end), {1, end - begin});
    alone.cu_seqlens = Tensor::from_vector<int32_t>({0, end - begin}, {2});
    const Tensor by_itself = cli::score_logprobs(*model, alone, 1, true);
    EXPECT_EQ(std::memcmp(together.data<float>() + begin, by_itself.data<float>(),
                          static_cast<size_t>(end - begin - 1) * sizeof(float)),
              0)
        << "document [" << begin << ", " << end << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyLayouts, ::testing::Values("deepseek_v2", "gpt_oss", "qwen3_5_moe"));

}  // namespace
}  // namespace moetrain::train
