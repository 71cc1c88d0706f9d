// Tests for ZeRO-3 sharded data parallelism through the Trainer on thread ranks (tiny Qwen3-MoE, f32 on the CPU):
// sharded training equals replicated training and one rank on the same global batch (dp 2, ep 2, dp 2 x ep 2), each
// rank holds about 1/N of the parameter, gradient and optimizer bytes, a checkpoint saved from the shards holds the
// replicated run's values and resumes the sharded run where it stopped, and the settings it cannot run are refused.
#include "train/fully_sharded.h"

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "io/job_config.h"
#include "testing/test_data.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace moetrain::train {
namespace {

io::JobConfig job(const std::string& sharding) {
  io::JobConfig c;
  c.model.config = testing::test_data_path("golden/qwen3_moe");
  c.model.init = "random";
  c.data.mode = "synthetic";
  c.train.steps = 3;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 8;
  c.optim.lr = 1e-3;
  c.optim.clip_grad_norm = 0.5;  // low enough that steps clip: the norm over the shards is exercised
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.metrics.console_every = 0;
  c.parallel.sharding = sharding;
  return c;
}

struct RunResult {
  std::vector<double> losses, grad_norms;
  std::vector<std::vector<float>> weights;
  bool sharded = false;
  int64_t shard_bytes = 0, optimizer_bytes = 0;
};

int64_t bytes_of(const std::vector<Tensor>& tensors) {
  int64_t n = 0;
  for (const Tensor& t : tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

RunResult run_mesh(const io::JobConfig& config, int world, int ep, int64_t steps = 0) {
  std::vector<RunResult> results(static_cast<size_t>(world));
  dist::run_local_ranks(world, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, 1, 1, ep, 8));
    Trainer trainer(config, &mesh);
    const TrainSummary summary = trainer.run(steps);
    RunResult& r = results[size_t(comm.rank())];
    r.losses = summary.losses;
    r.grad_norms = summary.grad_norms;
    r.sharded = trainer.sharded();
    if (trainer.sharded_model() != nullptr) r.shard_bytes = trainer.sharded_model()->shard_bytes();
    r.optimizer_bytes = bytes_of(trainer.optimizer().exp_avg()) + bytes_of(trainer.optimizer().exp_avg_sq());
    for (const Tensor& p : trainer.full_parameters()) r.weights.push_back(p.to_vector<float>());
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(results[size_t(r)].losses, results[0].losses) << "rank " << r;
    EXPECT_EQ(results[size_t(r)].weights, results[0].weights) << "rank " << r;
  }
  return results[0];
}

RunResult run_single(const io::JobConfig& config) {
  Trainer trainer(config);
  const TrainSummary summary = trainer.run();
  RunResult r{summary.losses, summary.grad_norms, {}, false, 0, 0};
  for (const Tensor& p : trainer.full_parameters()) r.weights.push_back(p.to_vector<float>());
  return r;
}

// fp32 sums in another order (per rank, then across ranks; the norm over shards): relative `tolerance`.
void expect_same_training(const RunResult& a, const RunResult& b, double tolerance) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], tolerance * std::abs(b.losses[i])) << "step " << i + 1;
    EXPECT_NEAR(a.grad_norms[i], b.grad_norms[i], tolerance * std::abs(b.grad_norms[i])) << "step " << i + 1;
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t t = 0; t < a.weights.size(); ++t) {
    const Tensor x = Tensor::from_vector(a.weights[t], {int64_t(a.weights[t].size())});
    const Tensor y = Tensor::from_vector(b.weights[t], {int64_t(b.weights[t].size())});
    EXPECT_LT(testing::relative_error(x, y), tolerance) << "parameter " << t;
  }
}

TEST(FullySharded, AutoShardsWithSeveralDataRanksAndNotWithOne) {
  EXPECT_TRUE(run_mesh(job("auto"), 2, 1, 1).sharded);
  EXPECT_FALSE(run_mesh(job("none"), 2, 1, 1).sharded);
  EXPECT_FALSE(run_mesh(job("auto"), 1, 1, 1).sharded);
}

TEST(FullySharded, ShardedTrainingEqualsReplicatedAndOneRank) {
  const RunResult single = run_single(job("none"));
  for (const auto& [world, ep] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}}) {
    SCOPED_TRACE("world " + std::to_string(world) + ", ep " + std::to_string(ep));
    const RunResult sharded = run_mesh(job("full"), world, ep);
    const RunResult replicated = run_mesh(job("none"), world, ep);
    ASSERT_TRUE(sharded.sharded);
    ASSERT_FALSE(replicated.sharded);
    // Sharded ranks sum each micro-batch's gradients across ranks then over micro-batches, replicated ones the
    // other way round: fp32 sums in another order, which AdamW amplifies where gradients are near zero.
    expect_same_training(sharded, replicated, 1e-5);
    expect_same_training(sharded, single, 1e-5);
  }
}

// Reducing once per step (the full gradients accumulated over the micro-batches first) sums in yet another order.
TEST(FullySharded, ReducingOncePerStepTrainsLikeReducingEveryMicroBatch) {
  io::JobConfig once = job("full");
  once.parallel.reduce_gradients = "step";
  for (const auto& [world, ep] : {std::pair{2, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE("world " + std::to_string(world) + ", ep " + std::to_string(ep));
    expect_same_training(run_mesh(once, world, ep), run_mesh(job("full"), world, ep), 1e-5);
  }
  EXPECT_THROW(
      {
        io::JobConfig valid = job("full");
        valid.metrics.console_every = 1;
        io::parse_job_config(io::job_config_to_toml(valid), "job.toml", {"parallel.reduce_gradients=layer"});
      },
      Error);
}

TEST(FullySharded, EachRankHoldsItsShareOfTheState) {
  const io::JobConfig config = job("full");
  Trainer whole(config);
  int64_t full_bytes = 0;  // masters + gradients (f32 compute: the weights are the masters); also the two moments
  for (const Tensor& p : whole.model().params().all_params()) full_bytes += 2 * static_cast<int64_t>(p.nbytes());
  const int64_t full_moments = full_bytes;
  for (const auto& [world, ep] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE("world " + std::to_string(world) + ", ep " + std::to_string(ep));
    const RunResult r = run_mesh(config, world, ep, 1);
    // 1/N of every tensor, plus at most one padding element per tensor and rank.
    const int64_t slack = 4 * 2 * static_cast<int64_t>(whole.model().params().specs().size());
    EXPECT_LE(r.shard_bytes, full_bytes / world + slack);
    EXPECT_GE(r.shard_bytes, full_bytes / world);
    EXPECT_LE(r.optimizer_bytes, full_moments / world + slack);
  }
}

// Runs `config` for 2 steps (the step-2 checkpoint in a fresh folder under `root`), then resumes it for step 3 on the
// same mesh: the straight run's loss and weights, to the byte.
void expect_resume_gives_the_straight_run(const io::JobConfig& config, const std::filesystem::path& root, int ep,
                                          const RunResult& straight) {
  io::JobConfig resumed = config;
  resumed.checkpoint.dir = (root / "resumed").string();
  run_mesh(resumed, 2, ep, 2);
  const RunResult rest = run_mesh(resumed, 2, ep);
  ASSERT_EQ(rest.losses.size(), 1u);
  EXPECT_EQ(rest.losses[0], straight.losses[2]);
  EXPECT_EQ(rest.weights, straight.weights);
}

TEST(FullySharded, CheckpointHoldsTheReplicatedValuesAndResumesTheShardedRun) {
  const std::filesystem::path root = testing::make_temp_dir("fully_sharded_checkpoint");
  io::JobConfig sharded = job("full");
  sharded.checkpoint.dir = (root / "sharded").string();
  sharded.checkpoint.every = 2;
  io::JobConfig replicated = job("none");
  replicated.checkpoint.dir = (root / "replicated").string();
  replicated.checkpoint.every = 2;
  const RunResult straight = run_mesh(sharded, 2, 2);
  run_mesh(replicated, 2, 2);

  const auto a = load_checkpoint(*find_latest_checkpoint(sharded.checkpoint.dir));
  const auto b = load_checkpoint(*find_latest_checkpoint(replicated.checkpoint.dir));
  ASSERT_EQ(a.model.size(), b.model.size());
  for (size_t i = 0; i < a.model.size(); ++i) {
    EXPECT_EQ(a.model[i].first, b.model[i].first);
    EXPECT_LT(testing::relative_error(a.model[i].second, b.model[i].second), 1e-5) << a.model[i].first;
  }
  ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
  for (size_t i = 0; i < a.optimizer.size(); ++i)
    EXPECT_LT(testing::relative_error(a.optimizer[i].second, b.optimizer[i].second), 1e-5) << a.optimizer[i].first;

  // Interrupted after step 2 (the step-2 checkpoint), resumed for step 3: the straight run's bytes.
  expect_resume_gives_the_straight_run(sharded, root, 2, straight);
  std::filesystem::remove_all(root);
}

// Each rank wrote its own file; another mesh (4 ranks, or one replicated rank) resumes from the assembled whole.
TEST(FullySharded, ACheckpointOfTwoRanksResumesOnFourRanksAndOnOne) {
  const std::filesystem::path root = testing::make_temp_dir("fully_sharded_other_mesh");
  io::JobConfig config = job("full");
  config.checkpoint.every = 2;
  config.checkpoint.dir = (root / "straight").string();
  const RunResult straight = run_mesh(config, 2, 1);
  const std::string first = (root / "straight" / "step_00000002").string();
  EXPECT_TRUE(is_sharded_checkpoint(first));
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(first) / "shard-00001-of-00002.safetensors"));

  for (const int world : {4, 1}) {
    SCOPED_TRACE("resumed on " + std::to_string(world) + " rank(s)");
    const std::filesystem::path dir = root / ("on_" + std::to_string(world));
    std::filesystem::create_directories(dir);
    std::filesystem::copy(first, dir / "step_00000002", std::filesystem::copy_options::recursive);
    io::JobConfig resumed = world == 1 ? job("none") : config;
    resumed.checkpoint.dir = dir.string();
    resumed.checkpoint.every = 2;
    const RunResult rest = world == 1 ? run_single(resumed) : run_mesh(resumed, world, 1);
    ASSERT_EQ(rest.losses.size(), 1u);
    EXPECT_NEAR(rest.losses[0], straight.losses[2], 1e-5 * std::abs(straight.losses[2]));
    RunResult last_step = straight;
    last_step.losses = {straight.losses[2]};
    last_step.grad_norms = {straight.grad_norms[2]};
    expect_same_training(rest, last_step, 1e-5);
  }
  std::filesystem::remove_all(root);
}

// optim.state_dtype = bf16 under ZeRO-3: each rank's moment shards in bf16 (half the f32 bytes), its checkpoint files
// too, and a stop and resume on the same mesh gives the straight run's bytes.
TEST(FullySharded, Bf16MomentsShardCheckpointAndResume) {
  const std::filesystem::path root = testing::make_temp_dir("fully_sharded_bf16_moments");
  io::JobConfig config = job("full");
  config.optim.state_dtype = "bf16";
  config.checkpoint.every = 2;
  config.checkpoint.dir = (root / "straight").string();
  const RunResult straight = run_mesh(config, 2, 1);
  EXPECT_TRUE(straight.sharded);
  io::JobConfig f32 = job("full");
  f32.checkpoint.dir = (root / "f32").string();
  const RunResult reference = run_mesh(f32, 2, 1);
  EXPECT_EQ(2 * straight.optimizer_bytes, reference.optimizer_bytes);
  expect_same_training(straight, reference, 1e-2);
  const CheckpointData saved = load_checkpoint((root / "straight" / "step_00000002").string());
  for (const auto& [name, tensor] : saved.optimizer) EXPECT_EQ(tensor.dtype(), DType::BF16) << name;

  expect_resume_gives_the_straight_run(config, root, 1, straight);
  std::filesystem::remove_all(root);
}

// A sharded checkpoint written with f32 moments, resumed on the same mesh by a job with bf16 moments: each rank reads
// its own file and rounds its moment slices (the log says so); the run goes on.
TEST(FullySharded, ASameMeshResumeConvertsTheMomentsToTheJobsStateDtype) {
  const std::filesystem::path root = testing::make_temp_dir("fully_sharded_convert_moments");
  io::JobConfig config = job("full");
  config.checkpoint.every = 2;
  config.checkpoint.dir = (root / "run").string();
  run_mesh(config, 2, 1, 2);
  config.optim.state_dtype = "bf16";
  ::testing::internal::CaptureStderr();
  const RunResult rest = run_mesh(config, 2, 1);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("AdamW moments converted to bf16"), std::string::npos) << log;
  ASSERT_EQ(rest.losses.size(), 1u);
  EXPECT_TRUE(std::isfinite(rest.losses[0]));
  const CheckpointData saved = load_checkpoint(*find_latest_checkpoint(config.checkpoint.dir));
  for (const auto& [name, tensor] : saved.optimizer) EXPECT_EQ(tensor.dtype(), DType::BF16) << name;
  std::filesystem::remove_all(root);
}

TEST(FullySharded, RefusesFullShardingWithPipelineParallelismAndUnknownModes) {
  io::JobConfig valid = job("auto");
  valid.metrics.console_every = 1;  // the test runs set 0 (silence), which a job file may not
  const std::string text = io::job_config_to_toml(valid);
  const auto parse = [&](const std::vector<std::string>& overrides) {
    return io::parse_job_config(text, "job.toml", overrides);
  };
  EXPECT_EQ(parse({"parallel.sharding=full"}).parallel.sharding, "full");
  EXPECT_EQ(parse({"parallel.sharding=none", "parallel.pp=2"}).parallel.pp, 2);
  for (const auto& [overrides, expected] :
       {std::pair<std::vector<std::string>, std::string>{{"parallel.sharding=zero3"}, "auto, full or none"},
        {{"parallel.sharding=full", "parallel.pp=2"}, "parallel.pp = 1"}}) {
    try {
      parse(overrides);
      ADD_FAILURE() << "accepted: " << overrides.back();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace moetrain::train
