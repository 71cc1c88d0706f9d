// Tests for pipeline-parallel training through the Trainer on thread ranks (DualPipeV on the mesh's pp axis), with
// the tiny MoE example (8 decoder layers, f32 on the CPU, synthetic data, auxiliary router losses on, clipping
// active): pp = 2 (balanced and with explicit cuts) and pp = 4 against one rank, pp = 2 x dp = 2 against dp = 2
// alone and against one rank, pp = 2 and 4 x ep = 2 against ep = 2 alone and against one rank, the whole model
// gathered into a checkpoint (with f32 or bf16 moments), and the refusals (fewer layers than stages, fewer
// micro-batches than 2P per pipeline).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "io/job_config.h"
#include "model/model_config.h"
#include "testing/test_data.h"
#include "train/checkpoint.h"
#include "train/launch.h"
#include "train/trainer.h"

namespace moetrain::train {
namespace {

constexpr int64_t kSteps = 5;

std::string tiny_moe_path() { return testing::repo_path("examples/tiny_moe/config.json"); }

// 8 micro-batches of 2 rows x 16 tokens per step: the minimum 2P for pp = 4, and 2P per pipeline for pp 2 x dp 2.
// The clip threshold is low enough that every step clips (checked in the single-rank run), so the pipeline's
// gradient norm over all parameters is exercised.
io::JobConfig job() {
  io::JobConfig c;
  c.model.config = tiny_moe_path();
  c.model.init = "random";
  c.data.mode = "synthetic";
  c.train.steps = kSteps;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 16;
  c.optim.lr = 1e-3;
  c.optim.clip_grad_norm = 0.5;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.metrics.console_every = 0;
  return c;
}

struct RankResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::map<std::string, std::vector<float>> owned;  // parameter name -> final values, the parameters the rank owns
};

struct MeshRun {
  std::vector<RankResult> ranks;  // by world rank
  std::vector<dist::MeshCoord> coords;
};

// Collective under ZeRO-3 (pp = 1 with several data ranks shards by default): every rank calls it.
RankResult result_of(Trainer& trainer, const TrainSummary& summary) {
  RankResult r{summary.losses, summary.grad_norms, {}};
  const auto& specs = trainer.model().params().specs();
  const std::vector<Tensor> params = trainer.full_parameters();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (trainer.owns_parameter(i)) r.owned[specs[i].name] = params[i].to_vector<float>();
  }
  return r;
}

// Trains `config` on pp x dp x ep thread ranks, at most `max_steps` steps when > 0.
MeshRun run_mesh(const io::JobConfig& config, int pp, int dp, int64_t max_steps = 0, int ep = 1) {
  const int world = pp * dp * ep;
  const int64_t experts = model::load_model_config(config.model.config).num_experts;
  MeshRun run;
  run.ranks.resize(static_cast<size_t>(world));
  run.coords.resize(static_cast<size_t>(world));
  std::mutex mu;
  dist::run_local_ranks(world, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, pp, 1, ep, experts));
    Trainer trainer(config, &mesh);
    const TrainSummary summary = trainer.run(max_steps);
    RankResult result = result_of(trainer, summary);
    std::lock_guard lock(mu);
    run.ranks[size_t(comm.rank())] = std::move(result);
    run.coords[size_t(comm.rank())] = mesh.coord();
  });
  return run;
}

RankResult run_single(const io::JobConfig& config) {
  Trainer trainer(config);
  const TrainSummary summary = trainer.run();
  return result_of(trainer, summary);
}

// The model of one data-parallel replica (dp index `dp_i`, ep index `ep_i`), assembled from the parameters its pp
// ranks own; checks that every parameter has exactly one owner among them and that all ranks report the same losses
// and norms.
RankResult assemble(const MeshRun& run, int dp_i, int ep_i = 0) {
  RankResult whole;
  bool first = true;
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    if (run.coords[r].dp != dp_i || run.coords[r].ep != ep_i) continue;
    const RankResult& rank = run.ranks[r];
    if (first) {
      whole.losses = rank.losses;
      whole.grad_norms = rank.grad_norms;
      first = false;
    } else {
      EXPECT_EQ(rank.losses, whole.losses) << "world rank " << r << ": every rank reports the step's loss";
      EXPECT_EQ(rank.grad_norms, whole.grad_norms) << "world rank " << r;
    }
    for (const auto& [name, values] : rank.owned) {
      EXPECT_TRUE(whole.owned.emplace(name, values).second) << name << " is owned by two pp ranks";
    }
  }
  return whole;
}

// Tolerance: none. The executor's loss and gradients are the bits of model::forward_backward (the CPU kernels are
// deterministic and batch-invariant, the wire is a byte copy); the clipping norm adds per-parameter sums of squares
// in the store's order whatever the cut; AdamW is elementwise.
void expect_bitwise(const RankResult& got, const RankResult& want, const std::string& where) {
  EXPECT_EQ(got.losses, want.losses) << where;
  EXPECT_EQ(got.grad_norms, want.grad_norms) << where;
  ASSERT_EQ(got.owned.size(), want.owned.size()) << where << ": every parameter has an owner";
  for (const auto& [name, values] : want.owned) {
    const auto it = got.owned.find(name);
    ASSERT_NE(it, got.owned.end()) << where << ": " << name;
    size_t differ = 0;
    for (size_t i = 0; i < values.size(); ++i) differ += it->second[i] == values[i] ? 0 : 1;
    EXPECT_EQ(differ, 0u) << where << ": " << name << " differs in " << differ << " of " << values.size()
                          << " elements";
  }
}

// Tolerance for a different fp32 summation order (the data-parallel all-reduce adds each replica's gradients after
// its own micro-batches): relative 1e-5, as tests/train/data_parallel_test.cpp.
void expect_close(const RankResult& got, const RankResult& want, const std::string& where) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << where;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::abs(want.losses[i])) << where << " step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-5 * std::abs(want.grad_norms[i]))
        << where << " step " << i + 1;
  }
  ASSERT_EQ(got.owned.size(), want.owned.size()) << where;
  for (const auto& [name, values] : want.owned) {
    const auto it = got.owned.find(name);
    ASSERT_NE(it, got.owned.end()) << where << ": " << name;
    const Tensor a = Tensor::from_vector(it->second, {int64_t(it->second.size())});
    const Tensor b = Tensor::from_vector(values, {int64_t(values.size())});
    EXPECT_LT(testing::relative_error(a, b), 1e-5) << where << ": " << name;
  }
}

const RankResult& reference() {
  static const RankResult single = [] {
    RankResult r = run_single(job());
    return r;
  }();
  return single;
}

// Synthetic data is fresh random tokens every step (nothing to learn beyond ln(vocab)), so the reference is checked
// for what the comparisons rely on: finite losses and a clipping norm above the threshold at every step.
TEST(PipelineTraining, SingleRankReferenceClipsEveryStep) {
  const RankResult& single = reference();
  ASSERT_EQ(single.losses.size(), size_t(kSteps));
  for (double loss : single.losses) EXPECT_TRUE(std::isfinite(loss));
  for (size_t s = 0; s < single.grad_norms.size(); ++s)
    EXPECT_GT(single.grad_norms[s], job().optim.clip_grad_norm) << "step " << s + 1 << " should clip";
}

TEST(PipelineTraining, TwoStagePairsTrainLikeOneRankBitwise) {
  expect_bitwise(assemble(run_mesh(job(), 2, 1), 0), reference(), "pp=2 balanced");
  io::JobConfig cuts = job();
  cuts.parallel.pp_cuts = {1, 2, 3};  // stages [0,1) [1,2) [2,3) [3,8): rank 0 holds layers 0 and 3..7
  expect_bitwise(assemble(run_mesh(cuts, 2, 1), 0), reference(), "pp=2 cuts 1,2,3");
}

TEST(PipelineTraining, FourStagePairsTrainLikeOneRankBitwise) {
  expect_bitwise(assemble(run_mesh(job(), 4, 1), 0), reference(), "pp=4");
}

// pp 2 x dp 2 on 4 ranks (pp outer, dp inner in the mesh's rank order): each replica's pipeline runs 4 of the 8
// micro-batches. Against replicated dp = 2 alone the only difference is the pipeline, so the bits are the same
// (ZeRO-3, the default for dp = 2 without a pipeline, sums in another order); against one rank the gradients are
// summed in another order.
TEST(PipelineTraining, PipelineTimesDataParallelTrainsLikeDataParallelAlone) {
  const MeshRun mixed = run_mesh(job(), 2, 2);
  const RankResult replica0 = assemble(mixed, 0);
  const RankResult replica1 = assemble(mixed, 1);
  expect_bitwise(replica1, replica0, "pp=2 x dp=2: replica 1 against replica 0");
  io::JobConfig replicated = job();
  replicated.parallel.sharding = "none";
  expect_bitwise(replica0, assemble(run_mesh(replicated, 1, 2), 0), "pp=2 x dp=2 against replicated dp=2");
  expect_close(replica0, assemble(run_mesh(job(), 1, 2), 0), "pp=2 x dp=2 against ZeRO-3 dp=2");
  expect_close(replica0, reference(), "pp=2 x dp=2 against one rank");
}

// The job path: dist.local_ranks = 4 with parallel.pp = 4 resolves the mesh and trains DualPipeV on thread ranks.
TEST(PipelineTraining, LaunchTrainsThreadRanksWithParallelPp) {
  io::JobConfig config = job();
  config.dist.local_ranks = 4;
  config.parallel.pp = 4;
  const TrainSummary summary = run_training_job(config);
  EXPECT_EQ(summary.losses, reference().losses);
  EXPECT_EQ(summary.grad_norms, reference().grad_norms);
}

// checkpoint.dir with pp = 2: the owned parameters and moments are gathered, and the first rank saves the whole
// model, which is the single-rank run's model bit for bit.
TEST(PipelineTraining, CheckpointHoldsTheWholeModel) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moetrain_pipeline_training_ckpt";
  std::filesystem::remove_all(dir);
  io::JobConfig config = job();
  config.checkpoint.dir = dir.string();
  config.checkpoint.resume = false;
  run_mesh(config, 2, 1);

  io::JobConfig plain = job();
  Trainer single(plain);
  single.run();
  const auto latest = find_latest_checkpoint(dir.string());
  ASSERT_TRUE(latest.has_value());
  const CheckpointData data = load_checkpoint(*latest);
  EXPECT_EQ(data.step, kSteps);
  const auto want = single.model().params().export_hf();
  ASSERT_EQ(data.model.size(), want.size());
  std::map<std::string, Tensor> saved(data.model.begin(), data.model.end());
  for (const auto& [name, tensor] : want) {
    ASSERT_TRUE(saved.count(name)) << name;
    EXPECT_EQ(saved.at(name).to_vector<float>(), tensor.to_vector<float>()) << name;
  }
  std::map<std::string, Tensor> moments(data.optimizer.begin(), data.optimizer.end());
  const auto& specs = single.model().params().specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(moments.at("exp_avg/" + specs[i].name).to_vector<float>(),
              single.optimizer().exp_avg()[i].to_vector<float>())
        << specs[i].name;
    EXPECT_EQ(moments.at("exp_avg_sq/" + specs[i].name).to_vector<float>(),
              single.optimizer().exp_avg_sq()[i].to_vector<float>())
        << specs[i].name;
  }
  std::filesystem::remove_all(dir);
}

// A pp = 2 run stopped after 3 steps (checkpoint at step 3) and resumed for the last 2 ends with the uninterrupted
// single-rank run's model, bit for bit: the checkpoint held the whole model and optimizer state.
TEST(PipelineTraining, ResumesFromAPipelineCheckpointLikeAnUninterruptedRun) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moetrain_pipeline_training_resume";
  std::filesystem::remove_all(dir);
  io::JobConfig config = job();
  config.checkpoint.dir = dir.string();
  config.checkpoint.every = 3;
  const MeshRun first = run_mesh(config, 2, 1, 3);
  ASSERT_EQ(list_checkpoints(dir.string()), (std::vector<int64_t>{3}));
  const MeshRun second = run_mesh(config, 2, 1);
  RankResult resumed = assemble(second, 0);
  const RankResult before = assemble(first, 0);
  resumed.losses.insert(resumed.losses.begin(), before.losses.begin(), before.losses.end());
  resumed.grad_norms.insert(resumed.grad_norms.begin(), before.grad_norms.begin(), before.grad_norms.end());
  expect_bitwise(resumed, reference(), "pp=2 resumed at step 3");
  std::filesystem::remove_all(dir);
}

// optim.state_dtype = bf16 through the pipeline: pp = 2 trains like one rank with bf16 moments, bit for bit, and a
// checkpoint (every rank's moments broadcast in bf16 to the saving one) resumes like the uninterrupted run.
TEST(PipelineTraining, Bf16MomentsTrainLikeOneRankAndResumeFromAPipelineCheckpoint) {
  io::JobConfig config = job();
  config.optim.state_dtype = "bf16";
  const RankResult single = run_single(config);
  expect_bitwise(assemble(run_mesh(config, 2, 1), 0), single, "pp=2, bf16 moments");
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moetrain_pipeline_bf16_moments";
  std::filesystem::remove_all(dir);
  config.checkpoint.dir = dir.string();
  config.checkpoint.every = 3;
  const MeshRun first = run_mesh(config, 2, 1, 3);
  for (const auto& [name, tensor] : load_checkpoint(*find_latest_checkpoint(dir.string())).optimizer)
    EXPECT_EQ(tensor.dtype(), DType::BF16) << name;
  RankResult resumed = assemble(run_mesh(config, 2, 1), 0);
  const RankResult before = assemble(first, 0);
  resumed.losses.insert(resumed.losses.begin(), before.losses.begin(), before.losses.end());
  resumed.grad_norms.insert(resumed.grad_norms.begin(), before.grad_norms.begin(), before.grad_norms.end());
  expect_bitwise(resumed, single, "pp=2 with bf16 moments resumed at step 3");
  std::filesystem::remove_all(dir);
}

// Runs Trainer construction on a pp x ep x dp mesh of thread ranks and returns the error text (every rank fails
// the same check before any collective).
std::string refusal(const io::JobConfig& config, int world, int pp, int ep) {
  const int64_t experts = model::load_model_config(config.model.config).num_experts;
  try {
    dist::run_local_ranks(world, [&](dist::Communicator& comm) {
      dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, pp, 1, ep, experts));
      Trainer trainer(config, &mesh);
    });
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "the trainer should refuse world " << world << ", pp " << pp << ", ep " << ep;
  return "";
}

TEST(PipelineTraining, RefusesFewerLayersThanStages) {
  io::JobConfig config = job();
  config.train.global_batch = 20;  // 10 micro-batches: enough for 2P = 10, so the layers are what fails
  const std::string e = refusal(config, 5, 5, 1);
  EXPECT_NE(e.find("pp = 5 needs 10 stages"), std::string::npos) << e;
  EXPECT_NE(e.find("the model has 8 layers"), std::string::npos) << e;
}

// Expert parallelism inside the pipeline: pp x ep = 2 against ep = 2 alone (pp = 1, the plain executor; sharding
// off so that both reduce gradients with the same all-reduce over dp x ep) and against one rank, 5 steps.
// Tolerances. Against ep = 2 alone: none (bitwise). Each ep rank's pipeline runs the micro-batches its pp = 1
// counterpart runs, the ep peers exchange rows micro-batch by micro-batch in both (so each expert's grouped GEMM sees
// the same rows), every parameter's gradient accumulates over the micro-batches in the same order, the all-reduce
// over dp x ep is the same, and the clipping norm adds per-parameter sums in the store's order in both. Against one
// rank: relative 1e-5 (expect_close, as pp = 2 x dp = 2), since the gradients of the two ep ranks' micro-batches are
// summed per rank and then across ranks. The two ep replicas end with the same bits.
void expect_pipeline_with_ep_trains_like_ep_alone(const io::JobConfig& config, int pp, const RankResult& single) {
  const std::string where = "pp=" + std::to_string(pp) + " x ep=2";
  const MeshRun mixed = run_mesh(config, pp, 1, 0, 2);
  const RankResult replica0 = assemble(mixed, 0, 0);
  expect_bitwise(assemble(mixed, 0, 1), replica0, where + ": ep replica 1 against ep replica 0");
  expect_bitwise(replica0, assemble(run_mesh(config, 1, 1, 0, 2), 0, 0), where + " against ep=2 alone");
  expect_close(replica0, single, where + " against one rank");
}

TEST(PipelineTraining, TwoStagePairsWithExpertParallelismTrainLikeExpertParallelismAlone) {
  io::JobConfig config = job();  // 8 micro-batches: 4 = 2P per pipeline
  config.parallel.sharding = "none";
  expect_pipeline_with_ep_trains_like_ep_alone(config, 2, reference());
}

TEST(PipelineTraining, FourStagePairsWithExpertParallelismTrainLikeExpertParallelismAlone) {
  io::JobConfig config = job();
  config.parallel.sharding = "none";
  config.train.global_batch = 32;  // 16 micro-batches: 8 = 2P per pipeline
  expect_pipeline_with_ep_trains_like_ep_alone(config, 4, run_single(config));
}

// parallel.schedule = dualpipev with pp = 1: each rank holds both chunks of the V and still pairs a forward with a
// backward (the overlap that hides one micro-batch's all-to-alls behind the other's compute on GPUs). Against the
// plain executor with ep = 2: bitwise, for the reasons above.
TEST(PipelineTraining, DualPipeVOnOneRankPerPipelineWithExpertParallelismTrainsLikeThePlainExecutor) {
  io::JobConfig config = job();
  config.parallel.sharding = "none";
  io::JobConfig dualpipev = config;
  dualpipev.parallel.schedule = "dualpipev";
  const MeshRun overlapped = run_mesh(dualpipev, 1, 1, 0, 2);
  expect_bitwise(assemble(overlapped, 0, 0), assemble(run_mesh(config, 1, 1, 0, 2), 0, 0),
                 "dualpipev pp=1 x ep=2 against the plain executor");
  expect_bitwise(assemble(overlapped, 0, 1), assemble(overlapped, 0, 0), "dualpipev pp=1 x ep=2: ep replicas");
  // One process has no mesh to run it over; ZeRO-3 runs on the plain executor only.
  try {
    Trainer alone(dualpipev);
    ADD_FAILURE() << "dualpipev without a mesh was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("schedule = dualpipev runs over a mesh"), std::string::npos) << e.what();
  }
  io::JobConfig full = dualpipev;
  full.parallel.sharding = "full";
  full.metrics.console_every = 1;
  EXPECT_THROW(io::parse_job_config(io::job_config_to_toml(full), "job.toml", {}), Error);
}

// exact.enabled in training: the job passes the admission contract, the residual is rounded to bf16 at every layer
// boundary, and pp = 2 (activations on a bf16 wire, checked with their metadata on every scheduled forward) trains
// like one rank in exact mode, bit for bit. Exact mode is a different program from the f32 one.
TEST(PipelineTraining, ExactModeTrainsThroughThePipelineLikeOneRankBitwise) {
  io::JobConfig config = job();
  config.exact.enabled = true;
  const RankResult single = run_single(config);
  expect_bitwise(assemble(run_mesh(config, 2, 1), 0), single, "exact pp=2");
  EXPECT_NE(single.losses, reference().losses) << "exact mode did not change the program";
}

TEST(PipelineTraining, ExactModeRefusesAJobItsContractDoesNotAdmit) {
  io::JobConfig config = job();
  config.exact.enabled = true;
  config.loss.load_balance = "global_batch";  // a loss without a pipeline path
  try {
    Trainer trainer(config);
    ADD_FAILURE() << "exact mode admitted the global-batch load-balance loss";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("global_batch"), std::string::npos) << e.what();
  }
}

TEST(PipelineTraining, RefusesFewerMicroBatchesThanTwoStagesPerRank) {
  io::JobConfig config = job();
  config.train.global_batch = 6;  // 3 micro-batches, one pipeline of pp = 2 needs 4
  std::string e = refusal(config, 2, 2, 1);
  EXPECT_NE(e.find(">= 2 * pp = 4 micro-batches per step per pipeline"), std::string::npos) << e;
  EXPECT_NE(e.find("gets 3"), std::string::npos) << e;

  config.train.global_batch = 12;  // 6 micro-batches over dp = 2: 3 per pipeline
  e = refusal(config, 4, 2, 1);
  EXPECT_NE(e.find("each of the 2 data-parallel pipelines gets 3"), std::string::npos) << e;
  EXPECT_NE(e.find("6 micro-batches shared by 2 data ranks"), std::string::npos) << e;
}

}  // namespace
}  // namespace moetrain::train
