// Tests for pipeline/forward_pipeline on thread ranks (in-process communicator, a pp x ep mesh) with the tiny MoE
// example in f32: the token log-probs equal model::forward_only's bit for bit for pp in {1, 2, 4} x ep in {1, 2}
// (each ep rank with micro-batches of its own); exact mode with a bf16 wire equals the single-rank exact program bit
// for bit; the wire check sees every activation that crosses a wire; and the refusals (a bf16 wire without exact
// mode, a bad wire dtype, unequal micro-batch counts, a failing rank) are errors on every rank, not hangs. Ranks
// other than pp rank 0 get micro-batches without tokens, so the metadata travelling with the activations is covered.
#include "pipeline/forward_pipeline.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "pipeline/partition.h"
#include "pipeline/plain_executor.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

using namespace fixtures;

constexpr uint64_t kSeed = 2468;

// What pp ranks other than 0 are given: n micro-batches without tokens.
std::vector<model::MicroBatch> without_data(const std::vector<model::MicroBatch>& batches) {
  return std::vector<model::MicroBatch>(batches.size());
}

// Micro-batches of ep rank e: different seeds and very different document lengths per rank.
std::vector<model::MicroBatch> batches_of_ep_rank(const model::ModelConfig& config, int ep, int e, int n) {
  const int min_len = e == 0 ? 20 : 2, max_len = e == 0 ? 40 : 6;
  return make_batches(n, 900 + static_cast<uint64_t>(10 * ep + e), config.vocab_size, min_len, max_len);
}

struct RunOptions {
  bool exact = false;
  DType wire = DType::F32;
  bool count_wire = false;
};

struct ForwardRun {
  std::map<int, std::vector<Tensor>> logprobs;  // world rank -> the run's result
  std::map<int, dist::MeshCoord> coords;
  std::map<int, int64_t> wire_calls;  // world rank -> wire-check calls
  std::map<int, std::string> errors;  // world rank -> what it threw (only when `expect_failure`)
};

// One ForwardPipeline::run over a pp x ep mesh of thread ranks; ep rank e's pp rank 0 reads per_ep[e].
ForwardRun run_forward(const model::ModelConfig& config, int pp, int ep,
                       const std::vector<std::vector<model::MicroBatch>>& per_ep, const RunOptions& options) {
  const Partition partition = partition_balanced(config, pp);
  ForwardRun run;
  std::mutex mu;
  dist::run_local_ranks(pp * ep, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(pp * ep, pp, 1, ep, config.num_experts));
    auto model = make_model(config, kSeed);
    model->set_exact(options.exact);
    ForwardPipeline pipeline(*model, partition, mesh.pp(), ep > 1 ? &mesh.ep() : nullptr);
    pipeline.set_wire_dtype(options.wire);
    int64_t calls = 0;
    if (options.count_wire) {
      pipeline.set_wire_check([&](const Tensor& activation, const model::MicroBatch& batch) {
        ++calls;
        EXPECT_EQ(activation.dtype(), options.wire);
        EXPECT_EQ(activation.size(0), batch.position_ids.numel());
        EXPECT_EQ(batch.cu_seqlens_host.to_vector<int32_t>().back(), activation.size(0));
      });
    }
    const auto& mine = per_ep[static_cast<size_t>(mesh.coord().ep)];
    std::vector<Tensor> result = pipeline.run(mesh.coord().pp == 0 ? mine : without_data(mine));
    std::lock_guard lock(mu);
    run.logprobs[comm.rank()] = std::move(result);
    run.coords[comm.rank()] = mesh.coord();
    run.wire_calls[comm.rank()] = calls;
  });
  return run;
}

// The single-rank forward_only log-probs of each ep rank's micro-batches.
std::vector<std::vector<Tensor>> reference_logprobs(const model::ModelConfig& config,
                                                    const std::vector<std::vector<model::MicroBatch>>& per_ep,
                                                    bool exact) {
  auto reference = make_model(config, kSeed);
  reference->set_exact(exact);
  std::vector<std::vector<Tensor>> want;
  for (const auto& batches : per_ep) {
    model::ForwardObservation observe;
    pipeline::forward_only(*reference, batches, &observe);
    want.push_back(observe.token_logprobs);
  }
  return want;
}

void expect_logprobs(const ForwardRun& run, const std::vector<std::vector<Tensor>>& want, const std::string& where) {
  for (const auto& [rank, got] : run.logprobs) {
    const dist::MeshCoord c = run.coords.at(rank);
    if (c.pp != 0) {
      EXPECT_TRUE(got.empty()) << where << ": pp rank " << c.pp << " returns nothing";
      continue;
    }
    const std::vector<Tensor>& w = want[static_cast<size_t>(c.ep)];
    ASSERT_EQ(got.size(), w.size()) << where << " ep rank " << c.ep;
    for (size_t mb = 0; mb < w.size(); ++mb) {
      EXPECT_TRUE(got[mb].device().is_cpu());
      EXPECT_TRUE(bitwise_equal(got[mb], w[mb])) << where << " ep rank " << c.ep << " micro-batch " << mb
                                                 << ": max |diff| " << testing::max_abs_diff(got[mb], w[mb]);
    }
  }
}

// Tolerance: none. The CPU kernels are deterministic and batch-invariant (an expert's rows give the same bits
// whichever ep rank computes them, next to whichever other rows), the expert exchange and the wire are byte copies,
// and each stage runs the same kernels as forward_only.
TEST(ForwardPipeline, LogProbsEqualForwardOnlyBitwise) {
  const model::ModelConfig config = tiny_moe();
  for (int pp : {1, 2, 4}) {
    for (int ep : {1, 2}) {
      const std::string where = "pp=" + std::to_string(pp) + " ep=" + std::to_string(ep);
      SCOPED_TRACE(where);
      std::vector<std::vector<model::MicroBatch>> per_ep;
      for (int e = 0; e < ep; ++e) per_ep.push_back(batches_of_ep_rank(config, ep, e, 3));
      const ForwardRun run = run_forward(config, pp, ep, per_ep, RunOptions{});
      expect_logprobs(run, reference_logprobs(config, per_ep, false), where);
    }
  }
}

// Exact mode: every stage boundary is rounded to bf16, so a bf16 wire carries the activations exactly and every cut
// gives the single-rank exact program's log-probs. Tolerance: none. Also shows that exact mode changes the result
// (the rounding is really applied inside the stages).
TEST(ForwardPipeline, ExactModeWithBf16WireEqualsSingleRankExactBitwise) {
  const model::ModelConfig config = tiny_moe();
  std::vector<std::vector<model::MicroBatch>> per_ep = {batches_of_ep_rank(config, 1, 0, 3)};
  const std::vector<std::vector<Tensor>> exact = reference_logprobs(config, per_ep, true);
  const std::vector<std::vector<Tensor>> plain = reference_logprobs(config, per_ep, false);
  EXPECT_FALSE(bitwise_equal(exact[0][0], plain[0][0])) << "exact mode should round the hidden state";
  RunOptions options;
  options.exact = true;
  options.wire = DType::BF16;
  for (int pp : {1, 2, 4}) {
    const std::string where = "pp=" + std::to_string(pp);
    SCOPED_TRACE(where);
    expect_logprobs(run_forward(config, pp, 1, per_ep, options), exact, where);
  }
  // With ep too.
  std::vector<std::vector<model::MicroBatch>> two = {batches_of_ep_rank(config, 2, 0, 2),
                                                     batches_of_ep_rank(config, 2, 1, 2)};
  expect_logprobs(run_forward(config, 2, 2, two, options), reference_logprobs(config, two, true), "pp=2 ep=2");
}

// Every activation crossing a wire is checked twice (by its sender and its receiver), in the wire dtype, with its
// metadata: per micro-batch rank 0 sends stage 0's output and receives stage 2P - 2's, rank P - 1 receives stage
// P - 2's and sends stage P's (the hand-over between its two stages is local), the middle ranks receive and send
// twice. pp = 1 has no wire.
TEST(ForwardPipeline, WireCheckSeesEveryTransferredActivation) {
  const model::ModelConfig config = tiny_moe();
  constexpr int kMicroBatches = 3;
  RunOptions options;
  options.count_wire = true;
  for (const bool exact : {false, true}) {
    options.exact = exact;
    options.wire = exact ? DType::BF16 : DType::F32;
    for (int pp : {1, 2, 4}) {
      SCOPED_TRACE("pp=" + std::to_string(pp) + (exact ? " exact" : ""));
      const ForwardRun run = run_forward(config, pp, 1, {batches_of_ep_rank(config, 1, 0, kMicroBatches)}, options);
      int64_t total = 0;
      for (const auto& [rank, calls] : run.wire_calls) {
        const int p = run.coords.at(rank).pp;
        const int64_t per_mb = pp == 1 ? 0 : (p == 0 || p == pp - 1 ? 2 : 4);
        EXPECT_EQ(calls, per_mb * kMicroBatches) << "pp rank " << p;
        total += calls;
      }
      EXPECT_EQ(total, 2 * kMicroBatches * (2 * pp - 2));
    }
  }
}

// Runs `fn` on every rank of a pp x ep mesh and collects what each throws; fails the test on a hang.
std::map<int, std::string> errors_of(int pp, int ep, const model::ModelConfig& config,
                                     const std::function<void(const dist::Mesh&, ForwardPipeline&)>& fn) {
  const Partition partition = partition_balanced(config, pp);
  std::mutex mu;
  std::map<int, std::string> errors;
  dist::LocalWorldOptions options;
  options.timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(dist::run_local_ranks(
                   pp * ep,
                   [&](dist::Communicator& comm) {
                     dist::Mesh mesh(comm.split(0, comm.rank(), "world"),
                                     dist::resolve_mesh(pp * ep, pp, 1, ep, config.num_experts));
                     auto model = make_model(config, kSeed);
                     ForwardPipeline pipeline(*model, partition, mesh.pp(), ep > 1 ? &mesh.ep() : nullptr);
                     try {
                       fn(mesh, pipeline);
                     } catch (const Error& e) {
                       std::lock_guard lock(mu);
                       errors[comm.rank()] = e.what();
                       throw;
                     }
                   },
                   options),
               Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "the ranks waited for the watchdog";
  return errors;
}

// Without exact mode the f32 activations are not on the bf16 grid: the sender refuses to cast them, naming exact
// mode; the receiver gets an error, not a hang.
TEST(ForwardPipeline, RefusesBf16WireWhenValuesAreOffTheGrid) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = batches_of_ep_rank(config, 1, 0, 2);
  const std::map<int, std::string> errors = errors_of(2, 1, config, [&](const dist::Mesh& mesh, ForwardPipeline& p) {
    p.set_wire_dtype(DType::BF16);
    p.run(mesh.coord().pp == 0 ? batches : without_data(batches));
  });
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors.at(0).find("is not on the bf16 grid"), std::string::npos) << errors.at(0);
  EXPECT_NE(errors.at(0).find("exact mode"), std::string::npos) << errors.at(0);
  EXPECT_NE(errors.at(1).find("rank 0"), std::string::npos) << errors.at(1);
}

TEST(ForwardPipeline, RefusesAWireDtypeOtherThanTheStreamOrBf16) {
  const model::ModelConfig config = tiny_moe();
  auto model = make_model(config, kSeed);
  dist::run_local_ranks(1, [&](dist::Communicator& comm) {
    ForwardPipeline pipeline(*model, partition_balanced(config, 1), comm);
    try {
      pipeline.set_wire_dtype(DType::F64);
      ADD_FAILURE() << "an f64 wire should be refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("residual stream dtype (f32) or bf16 with an f32 stream, found f64"),
                std::string::npos)
          << e.what();
    }
  });
}

// ep rank 1's pp rank 0 holds a token outside the vocabulary: it refuses its micro-batches before any transfer, and
// every other rank of the pp x ep mesh gets an error soon (none waits for the watchdog).
TEST(ForwardPipeline, FailingRankGivesTheOthersAnErrorNotAHang) {
  const model::ModelConfig config = tiny_moe();
  std::vector<std::vector<model::MicroBatch>> per_ep = {batches_of_ep_rank(config, 2, 0, 2),
                                                        batches_of_ep_rank(config, 2, 1, 2)};
  per_ep[1][1].input_ids.data<int32_t>()[0] = static_cast<int32_t>(config.vocab_size);
  const std::map<int, std::string> errors = errors_of(2, 2, config, [&](const dist::Mesh& mesh, ForwardPipeline& p) {
    const auto& mine = per_ep[static_cast<size_t>(mesh.coord().ep)];
    p.run(mesh.coord().pp == 0 ? mine : without_data(mine));
  });
  ASSERT_EQ(errors.size(), 4u);
  const int bad = dist::mesh_rank(dist::resolve_mesh(4, 2, 1, 2, config.num_experts), dist::MeshCoord{0, 0, 0, 1});
  EXPECT_NE(errors.at(bad).find("outside the vocabulary"), std::string::npos) << errors.at(bad);
  for (const auto& [rank, error] : errors) {
    if (rank != bad) {
      EXPECT_NE(error.find("rank"), std::string::npos) << "world rank " << rank << ": " << error;
    }
  }
}

TEST(ForwardPipeline, RefusesUnequalMicroBatchCounts) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = batches_of_ep_rank(config, 1, 0, 3);
  const std::map<int, std::string> errors = errors_of(2, 1, config, [&](const dist::Mesh& mesh, ForwardPipeline& p) {
    p.run(mesh.coord().pp == 0 ? batches : std::vector<model::MicroBatch>(2));
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& [rank, error] : errors)
    EXPECT_NE(error.find("must run the same number of micro-batches"), std::string::npos) << rank << ": " << error;
}

}  // namespace
}  // namespace moetrain::pipeline
