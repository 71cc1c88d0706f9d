// Tests for pipeline/dualpipev_executor and pipeline/stage_chunk on thread ranks (in-process communicator) with the
// tiny MoE example in f32: one step against the single-rank model::forward_backward (loss and every gradient of the
// layers a rank owns, bitwise), five AdamW steps against the single-rank trainer loop (losses and weights, bitwise),
// the stage interleaving of an overlapped pair, records freed, and the refusals (too few micro-batches, a failing
// rank). Ranks other than 0 get micro-batches without tokens, so every run also shows that the metadata travels
// with the activations. With expert parallelism (a pp x ep mesh of thread ranks, each ep rank with micro-batches of
// its own) the gradients summed over ep match the single-rank forward_backward over every micro-batch; exact mode
// with a bf16 wire matches the single-rank exact program bit for bit, and a bf16 wire without exact mode is refused.
#include "pipeline/dualpipev_executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "model/router_loss.h"
#include "pipeline/partition.h"
#include "pipeline/plain_executor.h"
#include "pipeline/stage_chunk.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"
#include "train/optimizer.h"

namespace moetrain::pipeline {
namespace {

using namespace fixtures;

constexpr uint64_t kSeed = 1234;
std::vector<model::MicroBatch> with_router_loss(std::vector<model::MicroBatch> batches,
                                                const model::RouterLossSettings* settings) {
  for (model::MicroBatch& b : batches) b.router_loss = settings;
  return batches;
}

// What ranks other than 0 are given: n empty micro-batches that carry only the step's router-loss settings.
std::vector<model::MicroBatch> without_data(const std::vector<model::MicroBatch>& batches) {
  std::vector<model::MicroBatch> empty(batches.size());
  for (size_t i = 0; i < batches.size(); ++i) empty[i].router_loss = batches[i].router_loss;
  return empty;
}

// The pipeline rank that owns parameter `name`: rank 0 for the embedding, final norm and head, else the rank of
// the stage holding its layer.
int owner_of(const std::string& name, const Partition& partition) {
  if (name.rfind("layers.", 0) != 0) return 0;
  const int64_t layer = std::stoll(name.substr(7, name.find('.', 7) - 7));
  for (const StageLayers& s : partition.stages) {
    if (layer >= s.first_layer && layer < s.end_layer) return s.rank;
  }
  ADD_FAILURE() << "no stage holds layer " << layer;
  return -1;
}

void expect_same_loss(const model::StepLoss& got, const model::StepLoss& want, const std::string& where) {
  EXPECT_EQ(got.loss, want.loss) << where;
  EXPECT_EQ(got.ce_sum, want.ce_sum) << where;
  EXPECT_EQ(got.num_targets, want.num_targets) << where;
  EXPECT_EQ(got.num_tokens, want.num_tokens) << where;
  EXPECT_EQ(got.load_balance, want.load_balance) << where;
  EXPECT_EQ(got.z_loss, want.z_loss) << where;
  EXPECT_EQ(got.device_balance, want.device_balance) << where;
}

struct PipelineRun {
  std::vector<std::vector<model::StepLoss>> losses;  // [rank][step]
  std::map<std::string, Tensor> grads;               // owned parameters' gradients after the last step
  std::map<std::string, Tensor> params;              // owned parameters after the last step
  std::vector<int64_t> live_records;                 // per rank, after the last step
};

// `steps` optimizer steps of DualPipeV over pp thread ranks, each rank with its own copy of the model (same seed);
// every rank keeps what it owns. With `train`, AdamW steps after each (the non-owned parameters of a rank's copy
// see zero gradients and are not compared).
PipelineRun run_pipeline(const model::ModelConfig& config, int pp,
                         const std::vector<std::vector<model::MicroBatch>>& steps, bool train) {
  const Partition partition = partition_balanced(config, pp);
  PipelineRun run;
  run.losses.resize(static_cast<size_t>(pp));
  run.live_records.resize(static_cast<size_t>(pp));
  std::mutex mu;
  dist::run_local_ranks(pp, [&](dist::Communicator& comm) {
    const int rank = comm.rank();
    auto model = make_model(config, kSeed);
    std::optional<train::AdamW> adamw;
    if (train) adamw.emplace(model->params(), train::AdamWConfig{});
    DualPipeVExecutor executor(*model, partition, comm);
    std::vector<model::StepLoss> losses;
    for (const auto& batches : steps) {
      model->params().zero_grads();
      losses.push_back(executor.run_step(rank == 0 ? batches : without_data(batches), 0));
      if (adamw) adamw->step(1e-2);
    }
    std::lock_guard lock(mu);
    run.losses[static_cast<size_t>(rank)] = losses;
    run.live_records[static_cast<size_t>(rank)] = executor.live_records();
    for (const model::ParamSpec& spec : model->params().specs()) {
      if (owner_of(spec.name, partition) != rank) continue;
      run.grads[spec.name] = model->params().grad(spec.name).clone();
      run.params[spec.name] = model->params().param(spec.name).clone();
    }
  });
  return run;
}

// Tolerance: none. The CPU kernels are deterministic and batch-invariant, the wire is a byte copy, each parameter's
// gradient accumulates over the micro-batches in the same order as the single-rank driver, and the step's sums are
// added up in its order, so the pipeline's loss and gradients are the same bits.
TEST(PipelineExecutor, MatchesSingleRankForwardBackwardBitwise) {
  const model::ModelConfig config = tiny_moe();
  for (int pp : {1, 2, 4}) {
    for (int n : {2 * pp, 2 * pp + 2}) {
      const std::string where = "pp=" + std::to_string(pp) + " n=" + std::to_string(n);
      SCOPED_TRACE(where);
      std::vector<model::MicroBatch> raw = make_batches(n, 100 + static_cast<uint64_t>(n), config.vocab_size);
      const model::RouterLossSettings settings = router_settings(config, count_targets(raw));
      const std::vector<model::MicroBatch> batches = with_router_loss(raw, &settings);

      auto reference = make_model(config, kSeed);
      const model::StepLoss want = pipeline::forward_backward(*reference, batches);
      EXPECT_GT(want.load_balance, 0.0);
      EXPECT_GT(want.device_balance, 0.0);

      const PipelineRun run = run_pipeline(config, pp, {batches}, false);
      for (int r = 0; r < pp; ++r) expect_same_loss(run.losses[static_cast<size_t>(r)][0], want, where);
      EXPECT_EQ(run.grads.size(), reference->params().specs().size()) << "every parameter has one owner";
      for (const auto& [name, grad] : run.grads) {
        const Tensor ref = reference->params().grad(name);
        EXPECT_TRUE(bitwise_equal(grad, ref)) << name << ": max |diff| " << testing::max_abs_diff(grad, ref)
                                              << ", relative error " << testing::relative_error(grad, ref);
      }
    }
  }
}

// Five AdamW steps on the same global batch (n = 8 micro-batches per step, the minimum for pp = 4): the
// single-rank loop (forward_backward, AdamW) against DualPipeV with pp = 1 (two chunks on one rank), 2 and 4.
// Tolerance: none (bitwise), for the reasons above and because AdamW is elementwise.
TEST(PipelineExecutor, FiveAdamWStepsMatchTheSingleRankLoopBitwise) {
  const model::ModelConfig config = tiny_moe();
  constexpr int kSteps = 5, kMicroBatches = 8;
  // The same global batch every step, so that the loss must fall.
  const std::vector<model::MicroBatch> raw = make_batches(kMicroBatches, 500, config.vocab_size);
  const model::RouterLossSettings settings = router_settings(config, count_targets(raw));
  const std::vector<std::vector<model::MicroBatch>> steps(kSteps, with_router_loss(raw, &settings));

  auto reference = make_model(config, kSeed);
  train::AdamW adamw(reference->params(), train::AdamWConfig{});
  std::vector<model::StepLoss> want;
  for (const auto& batches : steps) {
    reference->params().zero_grads();
    want.push_back(pipeline::forward_backward(*reference, batches));
    adamw.step(1e-2);
  }
  EXPECT_LT(want.back().loss, want.front().loss) << "the model should learn over the steps";

  for (int pp : {1, 2, 4}) {
    const std::string where = "pp=" + std::to_string(pp);
    SCOPED_TRACE(where);
    const PipelineRun run = run_pipeline(config, pp, steps, true);
    for (int r = 0; r < pp; ++r) {
      for (int s = 0; s < kSteps; ++s)
        expect_same_loss(run.losses[static_cast<size_t>(r)][static_cast<size_t>(s)], want[static_cast<size_t>(s)],
                         where + " rank " + std::to_string(r) + " step " + std::to_string(s));
    }
    EXPECT_EQ(run.params.size(), reference->params().specs().size());
    for (const auto& [name, param] : run.params) {
      const Tensor ref = reference->params().param(name);
      EXPECT_TRUE(bitwise_equal(param, ref)) << name << ": max |diff| " << testing::max_abs_diff(param, ref)
                                             << ", relative error " << testing::relative_error(param, ref);
    }
  }
}

TEST(PipelineExecutor, FreesEveryRecordByTheEndOfTheStep) {
  const model::ModelConfig config = tiny_moe();
  for (int pp : {1, 2, 4}) {
    const PipelineRun run = run_pipeline(config, pp, {make_batches(2 * pp + 1, 7, config.vocab_size)}, false);
    for (int r = 0; r < pp; ++r) EXPECT_EQ(run.live_records[static_cast<size_t>(r)], 0) << "pp=" << pp << " rank " << r;
  }
}

// A chunk holds a micro-batch's records from its forward until its weight gradients ran, and no longer.
TEST(PipelineExecutor, ChunkHoldsRecordsFromForwardToBackwardWeight) {
  const model::ModelConfig config = tiny_moe();
  auto model = make_model(config, kSeed);
  const Partition partition = partition_balanced(config, 1);
  const std::vector<model::MicroBatch> batches = make_batches(2, 3, config.vocab_size);
  StageChunk first(*model, partition.stages[0]);
  StageChunk last(*model, partition.stages[1]);

  const ChunkForward f0 = first.forward(0, batches[0], Tensor(), 0.5);
  const ChunkForward l0 = last.forward(0, batches[0], f0.hidden, 0.5);
  EXPECT_FALSE(l0.hidden.defined());
  EXPECT_EQ(l0.loss.num_targets(), batches[0].num_targets());
  EXPECT_EQ(first.live_records(), 1);
  EXPECT_EQ(last.live_records(), 1);
  const Tensor d_hidden = last.backward_input(0, Tensor(), 0.5);
  EXPECT_EQ(last.live_records(), 1) << "backward_input keeps the records for the weight gradients";
  last.backward_weight(0);
  EXPECT_EQ(last.live_records(), 0);
  EXPECT_FALSE(first.backward_full(0, d_hidden, 0.5).defined()) << "the embedding stage has no input gradient";
  EXPECT_EQ(first.live_records(), 0) << "a full backward frees the records at once";

  EXPECT_THROW(first.backward_input(1, d_hidden, 0.5), Error);  // never forwarded
  EXPECT_THROW(last.backward_weight(0), Error);                 // already freed
  first.forward(1, batches[1], Tensor(), 0.5);
  EXPECT_THROW(first.forward(1, batches[1], Tensor(), 0.5), Error);  // twice
  EXPECT_THROW(first.backward_weight(1), Error);                     // before its backward_input
}

TEST(PipelineExecutor, RefusesFewerMicroBatchesThanStages) {
  const model::ModelConfig config = tiny_moe();
  const Partition partition = partition_balanced(config, 2);
  const std::vector<model::MicroBatch> batches = make_batches(3, 11, config.vocab_size);
  try {
    dist::run_local_ranks(2, [&](dist::Communicator& comm) {
      auto model = make_model(config, kSeed);
      DualPipeVExecutor executor(*model, partition, comm);
      executor.run_step(batches, 0);
    });
    FAIL() << "3 micro-batches on pp = 2 should be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_microbatches >= 2 * num_ranks = 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("found 3"), std::string::npos) << e.what();
  }
}

// Rank 0 refuses a batch with a token outside the vocabulary before it sends anything; the other ranks, blocked
// waiting for its activations, get an error naming the failed rank well before the watchdog would fire.
TEST(PipelineExecutor, FailingRankGivesTheOthersAnErrorNotAHang) {
  const model::ModelConfig config = tiny_moe();
  const Partition partition = partition_balanced(config, 4);
  std::vector<model::MicroBatch> batches = make_batches(8, 13, config.vocab_size);
  batches[5].input_ids.data<int32_t>()[1] = static_cast<int32_t>(config.vocab_size);
  std::mutex mu;
  std::map<int, std::string> errors;
  dist::LocalWorldOptions options;
  options.timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(dist::run_local_ranks(
                   4,
                   [&](dist::Communicator& comm) {
                     auto model = make_model(config, kSeed);
                     DualPipeVExecutor executor(*model, partition, comm);
                     try {
                       executor.run_step(comm.rank() == 0 ? batches : without_data(batches), 0);
                     } catch (const Error& e) {
                       std::lock_guard lock(mu);
                       errors[comm.rank()] = e.what();
                       throw;
                     }
                   },
                   options),
               Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "the ranks waited for the watchdog";
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_NE(errors[0].find("outside the vocabulary"), std::string::npos) << errors[0];
  for (int r = 1; r < 4; ++r)
    EXPECT_NE(errors[r].find("rank 0"), std::string::npos) << "rank " << r << ": " << errors[r];
}

// An overlapped pair runs its two micro-batches stage by stage: F s1, F dispatch, B s5, B combine-backward, F s3,
// F combine, B s3, B dispatch-backward, F s5, B s1, ... (DualPipe's overlapped_forward_backward order).
TEST(PipelineExecutor, OverlappedPairInterleavesTheStagesOfItsTwoMicroBatches) {
  const model::ModelConfig config = tiny_moe();
  const Partition partition = partition_balanced(config, 2);
  const std::vector<model::MicroBatch> batches = make_batches(6, 17, config.vocab_size);
  std::vector<std::string> trace;
  dist::run_local_ranks(2, [&](dist::Communicator& comm) {
    auto model = make_model(config, kSeed);
    DualPipeVExecutor executor(*model, partition, comm);
    if (comm.rank() == 1) executor.set_trace(&trace);
    executor.run_step(comm.rank() == 0 ? batches : without_data(batches), 0);
  });
  // Rank 1 holds stages 1 and 2: no embedding, no head. Find its first pair.
  const std::vector<PipelineOp> ops = dualpipev_schedule(2, 1, 6);
  const auto pair =
      std::find_if(ops.begin(), ops.end(), [](const PipelineOp& op) { return op.kind == OpKind::OverlappedPair; });
  ASSERT_NE(pair, ops.end());
  const auto at = std::find(trace.begin(), trace.end(), "op: " + describe(*pair));
  ASSERT_NE(at, trace.end());
  const StageLayers& fs = pair->forward.chunk == 0 ? partition.down_stage(1) : partition.up_stage(1);
  const StageLayers& bs = pair->backward.chunk == 0 ? partition.down_stage(1) : partition.up_stage(1);
  const std::string f = "F mb" + std::to_string(pair->forward.microbatch) + " L" + std::to_string(fs.first_layer);
  const std::string b = "B mb" + std::to_string(pair->backward.microbatch) + " L" + std::to_string(bs.end_layer - 1);
  const std::vector<std::string> want = {f + " s1", f + " s2", b + " s5", b + " s4", f + " s3",
                                         f + " s4", b + " s3", b + " s2", f + " s5", b + " s1"};
  ASSERT_GE(trace.end() - at, static_cast<std::ptrdiff_t>(want.size() + 1));
  EXPECT_EQ(std::vector<std::string>(at + 1, at + 1 + static_cast<std::ptrdiff_t>(want.size())), want);
}

// One step of DualPipeV over a pp x ep mesh of thread ranks (dp = 1): ep rank e's pp rank 0 reads per_ep[e], with
// the global target count. The gradients are then summed over ep (as the trainer's all-reduce over dp x ep does);
// each (pp rank, ep rank 0) keeps the parameters it owns. Exact mode and the wire dtype as given; the wire check
// counts its calls (all ranks together).
struct EpRun {
  std::vector<model::StepLoss> losses;  // per ep rank (the same on every pp rank of it: checked)
  std::map<std::string, Tensor> grads;  // summed over ep
  int64_t wire_calls = 0;
};

EpRun run_pipeline_ep(const model::ModelConfig& config, int pp, int ep,
                      const std::vector<std::vector<model::MicroBatch>>& per_ep, int64_t global_targets, bool exact,
                      DType wire) {
  const Partition partition = partition_balanced(config, pp);
  EpRun run;
  run.losses.resize(static_cast<size_t>(ep));
  std::map<int, std::vector<model::StepLoss>> by_ep;
  std::mutex mu;
  dist::run_local_ranks(pp * ep, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(pp * ep, pp, 1, ep, config.num_experts));
    const dist::MeshCoord c = mesh.coord();
    auto model = make_model(config, kSeed);
    model->set_exact(exact);
    DualPipeVExecutor executor(*model, partition, mesh.pp(), ep > 1 ? &mesh.ep() : nullptr);
    executor.set_wire_dtype(wire);
    int64_t calls = 0;
    executor.set_wire_check([&](const Tensor& activation, const model::MicroBatch& batch) {
      ++calls;
      EXPECT_EQ(activation.dtype(), wire);
      EXPECT_EQ(activation.size(0), batch.position_ids.numel());
    });
    const auto& mine = per_ep[static_cast<size_t>(c.ep)];
    model->params().zero_grads();
    const model::StepLoss loss = executor.run_step(c.pp == 0 ? mine : without_data(mine), global_targets);
    EXPECT_EQ(executor.live_records(), 0);
    for (const model::ParamSpec& spec : model->params().specs())
      mesh.ep().all_reduce(Stream::cpu(), model->params().grad(spec.name), dist::ReduceOp::Sum);
    std::lock_guard lock(mu);
    run.wire_calls += calls;
    by_ep[c.ep].push_back(loss);
    if (c.ep != 0) return;
    for (const model::ParamSpec& spec : model->params().specs()) {
      if (owner_of(spec.name, partition) == c.pp) run.grads[spec.name] = model->params().grad(spec.name).clone();
    }
  });
  for (const auto& [e, losses] : by_ep) {
    for (const model::StepLoss& l : losses)
      expect_same_loss(l, losses.front(), "pp ranks of ep rank " + std::to_string(e));
    run.losses[static_cast<size_t>(e)] = losses.front();
  }
  return run;
}

// ep ranks as data ranks inside the pipeline: each ep rank's pipeline runs n = 2P micro-batches of its own (ep rank 0
// long documents, ep rank 1 short ones); after the sum over ep every gradient must equal forward_backward over all
// the micro-batches on one rank.
//
// Tolerances (the same as PlainExecutor's ep test). Gradients: relative error (||a - b|| / ||b|| per parameter
// tensor) <= 1e-5, measured worst 8.2e-8 (pp = 2) and 1.04e-7 (pp = 4); they are not bitwise because an expert's weight
// gradient adds the rows of both ep ranks' micro-batches in one grouped GEMM, and the non-expert gradients are summed
// per ep rank and then over ep (f32 additions associated differently, a few ulps). Inside the executor the expert rows
// compute identically (batch-invariant kernels, byte-copy exchanges), so each micro-batch's forward is the same bits:
// ce_sum, load balance and z-loss summed over the ep ranks differ from the reference only by the order of f64
// additions, relative 1e-12. Counts exact.
TEST(PipelineExecutor, ExpertParallelGradientsSumToSingleRank) {
  const model::ModelConfig config = tiny_moe();
  constexpr int kEp = 2;
  for (int pp : {2, 4}) {
    const std::string where = "pp=" + std::to_string(pp) + " ep=2";
    SCOPED_TRACE(where);
    std::vector<std::vector<model::MicroBatch>> per_ep;
    std::vector<model::MicroBatch> all;
    for (int e = 0; e < kEp; ++e) {
      per_ep.push_back(make_batches(2 * pp, 700 + static_cast<uint64_t>(10 * pp + e), config.vocab_size,
                                    e == 0 ? 20 : 2, e == 0 ? 40 : 6));
      all.insert(all.end(), per_ep.back().begin(), per_ep.back().end());
    }
    const int64_t global = count_targets(all);
    const model::RouterLossSettings settings = router_settings(config, global);
    for (auto& b : per_ep) b = with_router_loss(b, &settings);
    all = with_router_loss(all, &settings);

    auto reference = make_model(config, kSeed);
    const model::StepLoss want = pipeline::forward_backward(*reference, all, global);
    const EpRun run = run_pipeline_ep(config, pp, kEp, per_ep, global, false, DType::F32);

    double ce_sum = 0.0, loss = 0.0, load_balance = 0.0, z_loss = 0.0, device_balance = 0.0;
    int64_t targets = 0, tokens = 0;
    for (const model::StepLoss& l : run.losses) {
      ce_sum += l.ce_sum;
      loss += l.loss;
      targets += l.num_targets;
      tokens += l.num_tokens;
      load_balance += l.load_balance * static_cast<double>(l.num_tokens);
      z_loss += l.z_loss * static_cast<double>(l.num_tokens);
      device_balance += l.device_balance * static_cast<double>(l.num_tokens);
    }
    EXPECT_EQ(targets, want.num_targets);
    EXPECT_EQ(tokens, want.num_tokens);
    EXPECT_NEAR(ce_sum, want.ce_sum, 1e-12 * want.ce_sum);
    EXPECT_NEAR(loss, want.loss, 1e-12 * want.loss);
    EXPECT_NEAR(load_balance / static_cast<double>(tokens), want.load_balance, 1e-12 * want.load_balance);
    EXPECT_NEAR(z_loss / static_cast<double>(tokens), want.z_loss, 1e-12 * want.z_loss);
    EXPECT_NEAR(device_balance / static_cast<double>(tokens), want.device_balance, 1e-12 * want.device_balance);
    ASSERT_EQ(run.grads.size(), reference->params().specs().size()) << "every parameter has one owner";
    for (const auto& [name, grad] : run.grads)
      EXPECT_LE(testing::relative_error(grad, reference->params().grad(name)), 1e-5) << name;
  }
}

// Exact mode: the chunks round every stage boundary to bf16, so a bf16 wire carries the activations exactly and
// pp = 2 gives the single-rank exact program's step: loss and every gradient bit for bit (gradients travel in f32
// and pass straight through the rounding). The wire check sees each of the 2 transfers per micro-batch twice.
TEST(PipelineExecutor, ExactModeWithBf16WireMatchesSingleRankExactBitwise) {
  const model::ModelConfig config = tiny_moe();
  constexpr int kMicroBatches = 5;
  const std::vector<model::MicroBatch> raw = make_batches(kMicroBatches, 808, config.vocab_size);
  const model::RouterLossSettings settings = router_settings(config, count_targets(raw));
  const std::vector<model::MicroBatch> batches = with_router_loss(raw, &settings);

  auto reference = make_model(config, kSeed);
  reference->set_exact(true);
  const model::StepLoss want = pipeline::forward_backward(*reference, batches);
  auto inexact = make_model(config, kSeed);
  EXPECT_NE(pipeline::forward_backward(*inexact, batches).ce_sum, want.ce_sum) << "exact mode should change the loss";

  const EpRun run = run_pipeline_ep(config, 2, 1, {batches}, 0, true, DType::BF16);
  expect_same_loss(run.losses[0], want, "exact pp=2");
  EXPECT_EQ(run.wire_calls, 2 * 2 * kMicroBatches);
  ASSERT_EQ(run.grads.size(), reference->params().specs().size());
  for (const auto& [name, grad] : run.grads) {
    const Tensor ref = reference->params().grad(name);
    EXPECT_TRUE(bitwise_equal(grad, ref)) << name << ": max |diff| " << testing::max_abs_diff(grad, ref);
  }
}

// Without exact mode the activations are not on the bf16 grid: the first send refuses to cast them.
TEST(PipelineExecutor, RefusesBf16WireWithoutExactMode) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = make_batches(4, 19, config.vocab_size);
  const Partition partition = partition_balanced(config, 2);
  std::mutex mu;
  std::map<int, std::string> errors;
  EXPECT_THROW(dist::run_local_ranks(2,
                                     [&](dist::Communicator& comm) {
                                       auto model = make_model(config, kSeed);
                                       DualPipeVExecutor executor(*model, partition, comm);
                                       EXPECT_THROW(executor.set_wire_dtype(DType::F64), Error);
                                       executor.set_wire_dtype(DType::BF16);
                                       try {
                                         executor.run_step(comm.rank() == 0 ? batches : without_data(batches), 0);
                                       } catch (const Error& e) {
                                         std::lock_guard lock(mu);
                                         errors[comm.rank()] = e.what();
                                         throw;
                                       }
                                     }),
               Error);
  ASSERT_EQ(errors.count(0), 1u);
  EXPECT_NE(errors[0].find("is not on the bf16 grid"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("exact mode"), std::string::npos) << errors[0];
}

}  // namespace
}  // namespace moetrain::pipeline
