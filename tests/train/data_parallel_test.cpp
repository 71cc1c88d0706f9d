// Tests for data-parallel training on thread ranks (ZeRO-3 sharding, the default with several data ranks; the
// replicated mode is compared in fully_sharded_test.cpp): world 2 (dp 2) gives the loss and gradients of one rank on
// the same global batch, also when the ranks hold very different token counts, and so do ep 2 and dp 2 x ep 2 (also
// with DeepSeek-V2's device-level balance, whose groups default to the ep ranks).
#include "train/data_parallel.h"

#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "testing/test_data.h"
#include "train/trainer.h"

namespace moetrain::train {
namespace {

io::JobConfig job() {
  io::JobConfig c;
  c.model.config = testing::test_data_path("golden/qwen3_moe");
  c.model.init = "random";
  c.data.mode = "synthetic";
  c.train.steps = 3;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 8;
  c.optim.lr = 1e-3;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.metrics.console_every = 0;
  return c;
}

// A packed micro-batch of `documents` documents of `length` tokens each (ids from `seed`).
model::MicroBatch packed_batch(int64_t documents, int64_t length, uint64_t seed) {
  Rng rng(seed);
  const int64_t tokens = documents * length;
  std::vector<int32_t> ids(static_cast<size_t>(tokens)), targets(static_cast<size_t>(tokens));
  std::vector<int32_t> cu{0};
  for (int64_t i = 0; i < tokens; ++i) {
    ids[size_t(i)] = static_cast<int32_t>(rng.below(512));
    targets[size_t(i)] = (i + 1) % length == 0 ? -100 : static_cast<int32_t>(rng.below(512));
  }
  for (int64_t d = 1; d <= documents; ++d) cu.push_back(static_cast<int32_t>(d * length));
  return model::MicroBatch::packed(Tensor::from_vector(ids, {tokens}), Tensor::from_vector(targets, {tokens}),
                                   Tensor::from_vector(cu, {documents + 1}));
}

struct RunResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
};

// Collective under ZeRO-3 (the default with several data ranks): every rank calls it.
RunResult result_of(Trainer& trainer, const TrainSummary& summary) {
  RunResult r{summary.losses, {}};
  for (const Tensor& p : trainer.full_parameters()) r.weights.push_back(p.to_vector<float>());
  return r;
}

// Runs `config` on `world` thread ranks (dp = world); rank r trains on batches_of(r, step) when
// given. Returns rank 0's result and checks every rank ended with rank 0's weights.
RunResult run_ranks(const io::JobConfig& config, int world,
                    const std::function<std::vector<model::MicroBatch>(int, int64_t)>& batches_of = nullptr) {
  std::vector<RunResult> results(static_cast<size_t>(world));
  dist::run_local_ranks(world, [&](dist::Communicator& comm) {
    const dist::MeshShape shape = dist::resolve_mesh(world, 1, 1, 1, 8);
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), shape);
    Trainer trainer(config, &mesh);
    const int rank = comm.rank();
    if (batches_of) trainer.use_batch_source([&, rank](int64_t step) { return batches_of(rank, step); });
    const TrainSummary summary = trainer.run();
    results[size_t(rank)] = result_of(trainer, summary);
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(results[size_t(r)].losses, results[0].losses) << "rank " << r;
    EXPECT_EQ(results[size_t(r)].weights, results[0].weights) << "rank " << r;
  }
  return results[0];
}

RunResult run_single(const io::JobConfig& config,
                     const std::function<std::vector<model::MicroBatch>(int64_t)>& batches = nullptr) {
  Trainer trainer(config);
  if (batches) trainer.use_batch_source(batches);
  const TrainSummary summary = trainer.run();
  return result_of(trainer, summary);
}

// fp32 sums in another order (each rank's micro-batches, then across ranks): relative 1e-5.
void expect_same_training(const RunResult& ranks, const RunResult& single) {
  ASSERT_EQ(ranks.losses.size(), single.losses.size());
  for (size_t i = 0; i < ranks.losses.size(); ++i)
    EXPECT_NEAR(ranks.losses[i], single.losses[i], 1e-5 * std::abs(single.losses[i])) << "step " << i + 1;
  ASSERT_EQ(ranks.weights.size(), single.weights.size());
  for (size_t t = 0; t < ranks.weights.size(); ++t) {
    const Tensor a = Tensor::from_vector(ranks.weights[t], {int64_t(ranks.weights[t].size())});
    const Tensor b = Tensor::from_vector(single.weights[t], {int64_t(single.weights[t].size())});
    EXPECT_LT(testing::relative_error(a, b), 1e-5) << "parameter " << t;
  }
}

TEST(DataParallel, TwoRanksTrainLikeOneOnTheSameGlobalBatch) {
  const io::JobConfig config = job();
  expect_same_training(run_ranks(config, 2), run_single(config));
}

// The step's global batch: 40 + 4 tokens on rank 0, 112 + 8 on rank 1; one rank alone sees all four. ZeRO-3 needs
// the same number of micro-batches on every rank (its gathers are collective); replicated ranks may differ (44
// tokens in two micro-batches against 112 in one).
TEST(DataParallel, RanksWithVeryDifferentTokenCountsGiveTheTokenMean) {
  const auto batch = [](int which, int64_t step) {
    const uint64_t seed = 100 * uint64_t(step) + uint64_t(which);
    switch (which) {
      case 0: return packed_batch(5, 8, seed);
      case 1: return packed_batch(1, 4, seed);
      case 2: return packed_batch(4, 28, seed);
      default: return packed_batch(2, 4, seed);
    }
  };
  for (const bool sharded : {true, false}) {
    SCOPED_TRACE(sharded ? "sharded" : "replicated, uneven micro-batch counts");
    const int last = sharded ? 3 : 2;
    const auto per_rank = [&](int rank, int64_t step) {
      std::vector<model::MicroBatch> out = rank == 0 ? std::vector<model::MicroBatch>{batch(0, step), batch(1, step)}
                                                     : std::vector<model::MicroBatch>{batch(2, step)};
      if (rank == 1 && sharded) out.push_back(batch(3, step));
      return out;
    };
    const auto all = [&](int64_t step) {
      std::vector<model::MicroBatch> out;
      for (int which = 0; which <= last; ++which) out.push_back(batch(which, step));
      return out;
    };
    io::JobConfig config = job();
    config.parallel.sharding = sharded ? "full" : "none";
    expect_same_training(run_ranks(config, 2, per_rank), run_single(config, all));
  }
}

TEST(DataParallel, ShardedRanksRefuseUnequalMicroBatchCountsTogether) {
  io::JobConfig config = job();
  config.parallel.sharding = "full";
  const auto per_rank = [](int rank, int64_t step) {
    std::vector<model::MicroBatch> out{packed_batch(2, 8, uint64_t(step))};
    if (rank == 0) out.push_back(packed_batch(2, 8, uint64_t(step) + 50));
    return out;
  };
  try {
    run_ranks(config, 2, per_rank);
    ADD_FAILURE() << "unequal micro-batch counts were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("same number of micro-batches"), std::string::npos) << e.what();
  }
}

TEST(DataParallel, TheGlobalTargetCountIsSummedOverRanks) {
  std::vector<int64_t> counts(3);
  dist::run_local_ranks(3, [&](dist::Communicator& comm) {
    counts[size_t(comm.rank())] = all_reduce_sum(comm, Device::cpu(), int64_t{10} * (comm.rank() + 1));
  });
  EXPECT_EQ(counts, (std::vector<int64_t>{60, 60, 60}));
}

// ep 2 (and dp 2 x ep 2 on 4 ranks): each ep rank computes its own experts, the expert gradients
// meet in the all-reduce; the same global batch as one rank (fp32 sums in another order: 1e-5).
// With the de-duplicated dispatch (each token once per destination rank) and with one row per (token, expert).
TEST(DataParallel, ExpertParallelRanksTrainLikeOne) {
  io::JobConfig config = job();
  const RunResult single = run_single(config);
  for (const auto& [world, ep, dedup] : {std::tuple{2, 2, true}, std::tuple{4, 2, true}, std::tuple{2, 2, false}}) {
    SCOPED_TRACE("world " + std::to_string(world) + ", ep " + std::to_string(ep) + (dedup ? "" : ", rows"));
    config.parallel.ep_dedup = dedup;
    std::vector<RunResult> results(static_cast<size_t>(world));
    dist::run_local_ranks(world, [&](dist::Communicator& comm) {
      dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, 1, 1, ep, 8));
      Trainer trainer(config, &mesh);
      const TrainSummary summary = trainer.run();
      results[size_t(comm.rank())] = result_of(trainer, summary);
    });
    expect_same_training(results[0], single);
  }
}

// DeepSeek-V2's device-level balance over 2 groups of the 8 experts: ep 2 (its default groups, one per ep rank, and
// the same count given explicitly) trains like one rank given D = 2, and reports the same device balance (fp32 sums
// in another order: 1e-5, as the losses).
TEST(DataParallel, ExpertParallelRanksTrainLikeOneWithTheDeviceBalance) {
  const std::string dir = testing::make_temp_dir("dp_device_balance");
  io::JobConfig config = job();
  config.loss.device_balance_coef = 0.05;
  config.loss.device_balance_groups = 2;
  config.metrics.jsonl = dir + "/single.jsonl";
  const RunResult single = run_single(config);
  const auto device_balance_of = [](const std::string& path) {
    std::ifstream in(path);
    std::vector<double> values;
    for (std::string line; std::getline(in, line);) values.push_back(nlohmann::json::parse(line)["device_balance"]);
    return values;
  };
  const std::vector<double> want = device_balance_of(config.metrics.jsonl);
  ASSERT_EQ(want.size(), 3u);
  for (const int64_t groups : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE("loss.device_balance_groups = " + std::to_string(groups));
    config.loss.device_balance_groups = groups;
    config.metrics.jsonl = dir + "/ep" + std::to_string(groups) + ".jsonl";
    std::vector<RunResult> results(2);
    dist::run_local_ranks(2, [&](dist::Communicator& comm) {
      dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(2, 1, 1, 2, 8));
      Trainer trainer(config, &mesh);
      const TrainSummary summary = trainer.run();
      results[size_t(comm.rank())] = result_of(trainer, summary);
    });
    expect_same_training(results[0], single);
    const std::vector<double> got = device_balance_of(config.metrics.jsonl);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace moetrain::train
