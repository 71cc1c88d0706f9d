// Tests for the held-out evaluation of train/trainer ([eval]) and the per-layer load balance of the metrics: the eval
// loss is the forward-only loss of the first eval.tokens tokens of the held-out set in file order (checked against
// pipeline::forward_only), the same at every evaluation and after a resume, logged as eval_loss / eval_tokens, and
// leaves training bit for bit as it was; a bad held-out path or a malformed .idx stops the job before any file is
// written; on thread ranks the pipeline (pp = 2), data parallelism (ZeRO-3) and expert parallelism give the single
// rank's eval loss, DualPipeV gives the plain executor's layer_load_balance, and exact mode keeps the eval bitwise.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "io/job_config.h"
#include "model/model_config.h"
#include "pipeline/plain_executor.h"
#include "testing/test_data.h"
#include "train/data/indexed_dataset.h"
#include "train/data/loader.h"
#include "train/trainer.h"

namespace moetrain::train {
namespace {

namespace fs = std::filesystem;

// Documents of ids in [1, vocab) counting up by a stride of 1 or 2 from a random start, ending with 0.
std::string make_dataset(const std::string& prefix, int documents, uint64_t seed, int64_t vocab) {
  data::IndexedDatasetBuilder builder(prefix, 8 /* uint16 */);
  Rng rng(seed);
  for (int d = 0; d < documents; ++d) {
    std::vector<int32_t> tokens(static_cast<size_t>(5 + rng.below(40)));
    const int64_t start = static_cast<int64_t>(rng.below(static_cast<uint64_t>(vocab - 1)));
    const int64_t stride = 1 + static_cast<int64_t>(rng.below(2));
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(1 + (start + stride * int64_t(i)) % (vocab - 1));
    }
    tokens.push_back(0);
    builder.add_sequence(tokens);
  }
  builder.finish();
  return prefix;
}

// The golden Qwen3-MoE (3 layers, the first dense): 2 MoE layers.
io::JobConfig golden_job(const std::string& dir) {
  io::JobConfig c;
  c.model.config = testing::test_data_path("golden/qwen3_moe");
  c.model.init = "random";
  c.data.sources = {{make_dataset(dir + "/train", 60, 77, 512), 1.0}};
  c.train.steps = 6;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 4;
  c.optim.lr = 1e-3;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.metrics.console_every = 0;
  c.eval.sources = {{make_dataset(dir + "/heldout", 20, 78, 512), 1.0}};
  c.eval.every = 2;
  c.eval.tokens = 100;  // 4 micro-batches of 2 x 16 tokens (rounded up from 3.125)
  return c;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(TrainerEval, EvaluatesEveryNStepsAndAfterTheLastAndLogsIt) {
  const std::string dir = testing::make_temp_dir("eval_logged");
  io::JobConfig job = golden_job(dir);
  job.train.steps = 5;
  job.metrics.jsonl = dir + "/metrics.jsonl";
  Trainer trainer(job);
  EXPECT_EQ(trainer.eval_micro_batches(), 4);
  const TrainSummary summary = trainer.run();
  EXPECT_EQ(summary.eval_steps, (std::vector<int64_t>{2, 4, 5}));
  const std::vector<nlohmann::json> records = read_jsonl(job.metrics.jsonl);
  ASSERT_EQ(records.size(), 5u);
  for (const nlohmann::json& r : records) {
    const int64_t step = r.at("step").get<int64_t>();
    const bool evaluated = step == 2 || step == 4 || step == 5;
    EXPECT_EQ(r.contains("eval_loss"), evaluated) << r.dump();
    EXPECT_EQ(r.contains("eval_tokens"), evaluated) << r.dump();
    if (evaluated) {
      EXPECT_EQ(r.at("eval_tokens").get<int64_t>(), 4 * 2 * 16) << "packed: every position has a target";
      EXPECT_TRUE(std::isfinite(r.at("eval_loss").get<double>()));
    }
    // The golden model's layer 0 is dense: one value per MoE layer (layers 1 and 2).
    ASSERT_TRUE(r.contains("layer_load_balance")) << r.dump();
    const auto layers = r.at("layer_load_balance").get<std::vector<double>>();
    ASSERT_EQ(layers.size(), 2u);
    // lb_loss is the mean over the MoE layers of the same token-weighted values (relative 1e-12: two summation
    // orders of the same doubles).
    EXPECT_NEAR((layers[0] + layers[1]) / 2, r.at("lb_loss").get<double>(), 1e-12 * r.at("lb_loss").get<double>());
    for (double lb : layers) EXPECT_TRUE(std::isfinite(lb) && lb > 0.0) << lb;
  }
  EXPECT_EQ(summary.eval_losses.back(), records.back().at("eval_loss").get<double>());
}

// The eval is the forward-only loss of the held-out set's first micro-batches in file order: the same micro-batches
// a fresh unshuffled loader gives, through model::forward_only; calling it again gives the same bits.
TEST(TrainerEval, IsTheForwardOnlyLossOfTheFirstHeldOutTokensInFileOrder) {
  const std::string dir = testing::make_temp_dir("eval_reference");
  const io::JobConfig job = golden_job(dir);
  Trainer trainer(job);
  trainer.run(3);
  const EvalResult first = trainer.evaluate();
  const EvalResult again = trainer.evaluate();
  EXPECT_EQ(first.loss, again.loss);
  EXPECT_EQ(first.tokens, again.tokens);

  data::LoaderOptions o;
  o.sources = job.eval.sources;
  o.mode = "packed";
  o.shuffle = false;
  o.seq_len = job.train.seq_len;
  o.micro_batch = job.train.micro_batch;
  o.vocab_size = trainer.model().config().vocab_size;
  data::DataLoader loader(o);
  std::vector<model::MicroBatch> batches;
  for (int i = 0; i < 4; ++i) batches.push_back(loader.next());
  const model::StepLoss want = pipeline::forward_only(trainer.model(), batches);
  EXPECT_EQ(first.loss, want.ce_sum / static_cast<double>(want.num_targets));
  EXPECT_EQ(first.tokens, want.num_targets);
}

// Evaluating changes nothing of the training: the losses and weights of a run with eval every step are those of a
// run without; a resumed run evaluates the same held-out tokens and gets the straight run's eval loss.
TEST(TrainerEval, LeavesTrainingUnchangedAndResumesToTheSameEvalLoss) {
  const std::string dir_a = testing::make_temp_dir("eval_off");
  io::JobConfig off = golden_job(dir_a);
  off.eval.every = 0;
  Trainer plain(off);
  const TrainSummary without = plain.run();
  EXPECT_TRUE(without.eval_steps.empty());

  const std::string dir_b = testing::make_temp_dir("eval_on");
  io::JobConfig on = golden_job(dir_b);
  on.eval.every = 1;
  on.checkpoint.dir = dir_b + "/ckpt";
  on.checkpoint.every = 3;
  Trainer evaluated(on);
  const TrainSummary with = evaluated.run();
  EXPECT_EQ(with.losses, without.losses);
  EXPECT_EQ(with.grad_norms, without.grad_norms);
  ASSERT_EQ(with.eval_losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(std::isfinite(with.eval_losses[i])) << i;
  const std::vector<Tensor> a = plain.full_parameters(), b = evaluated.full_parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].to_vector<float>(), b[i].to_vector<float>()) << i;

  // Resume from the step-3 checkpoint of a copy: the eval after step 6 is the straight run's.
  fs::remove_all(on.checkpoint.dir + "/step_00000006");
  Trainer resumed(on);
  EXPECT_EQ(resumed.steps_done(), 3);
  const TrainSummary rest = resumed.run();
  ASSERT_EQ(rest.eval_losses.size(), 3u);
  EXPECT_EQ(rest.eval_losses.back(), with.eval_losses.back());
}

// Nothing may be written when the job is refused: no JSONL, no TensorBoard folder, no checkpoint folder.
void expect_refused_before_writing(const io::JobConfig& job, const std::string& needle) {
  try {
    Trainer trainer(job);
    ADD_FAILURE() << "the job was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("eval"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(job.metrics.jsonl));
  EXPECT_FALSE(fs::exists(job.metrics.tensorboard));
  EXPECT_FALSE(fs::exists(job.checkpoint.dir));
}

TEST(TrainerEval, RefusesAMissingOrMalformedHeldOutSetBeforeWritingAnything) {
  const std::string dir = testing::make_temp_dir("eval_bad_path");
  io::JobConfig job = golden_job(dir);
  job.metrics.jsonl = dir + "/out/metrics.jsonl";
  job.metrics.tensorboard = dir + "/out/tb";
  job.checkpoint.dir = dir + "/out/ckpt";
  job.eval.sources = {{dir + "/no_such_prefix", 1.0}};
  expect_refused_before_writing(job, "no_such_prefix");

  // A .idx that is not a Megatron index (and an empty .bin).
  const std::string bad = dir + "/malformed";
  std::ofstream(bad + ".idx", std::ios::binary) << "this is not an index file at all";
  std::ofstream(bad + ".bin", std::ios::binary);
  job.eval.sources = {{bad, 1.0}};
  expect_refused_before_writing(job, "malformed.idx");

  // Token ids outside the model's vocabulary (512) are found at startup too, not at the first evaluation.
  job.eval.sources = {{make_dataset(dir + "/wide", 10, 5, 60000), 1.0}};
  expect_refused_before_writing(job, "outside the model's vocabulary");
}

// ---- thread ranks: the tiny MoE example (8 MoE layers), synthetic training data, a held-out file ----

std::string tiny_moe_path() { return testing::repo_path("examples/tiny_moe/config.json"); }

io::JobConfig tiny_job(const std::string& dir) {
  io::JobConfig c;
  c.model.config = tiny_moe_path();
  c.model.init = "random";
  c.data.mode = "synthetic";
  c.train.steps = 2;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 8;  // 4 micro-batches: 2P for pp = 2
  c.optim.lr = 1e-3;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.metrics.console_every = 0;
  c.eval.sources = {{make_dataset(dir + "/heldout", 30, 9, 257), 1.0}};
  c.eval.every = 1;
  c.eval.tokens = 4 * 32;  // 4 micro-batches: 2 per rank with 2 data ranks
  return c;
}

struct RankRun {
  std::vector<double> losses, eval_losses;
  std::vector<double> layer_load_balance;  // steps x MoE layers
};

// Every rank's summary, by world rank.
std::vector<RankRun> run_mesh(const io::JobConfig& config, int pp, int dp, int ep) {
  const int world = pp * dp * ep;
  const int64_t experts = model::load_model_config(config.model.config).num_experts;
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::mutex mu;
  dist::run_local_ranks(world, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, pp, 1, ep, experts));
    Trainer trainer(config, &mesh);
    const TrainSummary s = trainer.run();
    std::lock_guard lock(mu);
    runs[static_cast<size_t>(comm.rank())] = {s.losses, s.eval_losses, s.layer_load_balance};
  });
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].eval_losses, runs[0].eval_losses) << "world rank " << r << " reports the same eval loss";
  }
  return runs;
}

RankRun run_single(const io::JobConfig& config) {
  Trainer trainer(config);
  const TrainSummary s = trainer.run();
  return {s.losses, s.eval_losses, s.layer_load_balance};
}

// pp = 2 runs the eval through DualPipeV's forward pipeline: the single rank's bits (the training is bitwise equal,
// tests/train/pipeline_training_test.cpp, and the pipeline's loss stage sums the cross-entropy in the same order).
// The per-layer load balance of DualPipeV equals the plain executor's, bit for bit.
TEST(TrainerEval, PipelineEvaluatesAndBalancesLikeOneRankBitwise) {
  const std::string dir = testing::make_temp_dir("eval_pp");
  const io::JobConfig job = tiny_job(dir);
  const RankRun single = run_single(job);
  ASSERT_EQ(single.eval_losses.size(), 2u);
  ASSERT_EQ(single.layer_load_balance.size(), 2u * 8u) << "one value per MoE layer (8) at each of the 2 steps";
  const std::vector<RankRun> pp2 = run_mesh(job, 2, 1, 1);
  EXPECT_EQ(pp2[0].losses, single.losses);
  EXPECT_EQ(pp2[0].eval_losses, single.eval_losses);
  for (const RankRun& rank : pp2) EXPECT_EQ(rank.layer_load_balance, single.layer_load_balance);
}

// dp = 2 (ZeRO-3 by default) and ep = 2 split the held-out micro-batches over two data ranks: the token-weighted
// sums are added in another order. Tolerance: relative 1e-5, as the training losses of data parallelism
// (tests/train/data_parallel_test.cpp: the replicas' weights differ in the last bits after a step). DualPipeV over
// pp = 1 x ep = 2 gives the plain executor's per-layer load balance and eval loss bit for bit.
TEST(TrainerEval, DataAndExpertParallelEvaluateLikeOneRank) {
  const std::string dir = testing::make_temp_dir("eval_dp_ep");
  const io::JobConfig job = tiny_job(dir);
  const RankRun single = run_single(job);
  for (const auto& [dp, ep] : {std::pair{2, 1}, std::pair{1, 2}}) {
    const std::vector<RankRun> runs = run_mesh(job, 1, dp, ep);
    ASSERT_EQ(runs[0].eval_losses.size(), single.eval_losses.size());
    for (size_t i = 0; i < single.eval_losses.size(); ++i) {
      EXPECT_NEAR(runs[0].eval_losses[i], single.eval_losses[i], 1e-5 * single.eval_losses[i])
          << "dp " << dp << " ep " << ep << " eval " << i;
    }
    ASSERT_EQ(runs[0].layer_load_balance.size(), single.layer_load_balance.size());
    for (size_t i = 0; i < single.layer_load_balance.size(); ++i) {  // steps x 8 MoE layers
      EXPECT_NEAR(runs[0].layer_load_balance[i], single.layer_load_balance[i], 1e-5 * single.layer_load_balance[i])
          << "dp " << dp << " ep " << ep << " step " << i / 8 << " layer " << i % 8;
    }
  }
  io::JobConfig plain = job;
  plain.parallel.sharding = "none";
  io::JobConfig dualpipev = plain;
  dualpipev.parallel.schedule = "dualpipev";
  const std::vector<RankRun> a = run_mesh(plain, 1, 1, 2), b = run_mesh(dualpipev, 1, 1, 2);
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(b[r].layer_load_balance, a[r].layer_load_balance) << "ep rank " << r;
    EXPECT_EQ(b[r].eval_losses, a[r].eval_losses) << "ep rank " << r;
  }
}

// Exact mode admits a job with [eval] (the eval adds no kernel), and the eval is bitwise: pp = 2 gives one rank's.
TEST(TrainerEval, ExactModeAdmitsTheJobAndItsEvalIsBitwiseThroughThePipeline) {
  const std::string dir = testing::make_temp_dir("eval_exact");
  io::JobConfig job = tiny_job(dir);
  job.exact.enabled = true;
  const RankRun single = run_single(job);
  ASSERT_EQ(single.eval_losses.size(), 2u);
  const std::vector<RankRun> pp2 = run_mesh(job, 2, 1, 1);
  EXPECT_EQ(pp2[0].eval_losses, single.eval_losses);
  EXPECT_EQ(pp2[0].layer_load_balance, single.layer_load_balance);
}

}  // namespace
}  // namespace moetrain::train
