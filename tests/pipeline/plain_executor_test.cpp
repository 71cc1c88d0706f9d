// Tests for pipeline/plain_executor on thread ranks (in-process communicator) with the tiny MoE example
// (examples/tiny_moe: E = 8, top-2, 8 MoE layers) in f32, random init, auxiliary router losses on: without ep (and
// with an ep group of one) it is model::forward_backward bit for bit; with ep = 2 and 4 each rank holds different
// micro-batches of very different token counts, and the gradients summed over the ep ranks equal one rank running
// every micro-batch with forward_backward; gradients of experts a rank does not own stay 0 on it; and the refusals
// (unequal micro-batch counts, one rank's bad input stopping every rank). The forward alone (run_forward, the scoring
// path) gives forward_only's log-probs bit for bit, with and without ep.
#include "pipeline/plain_executor.h"

#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "dist/inprocess_communicator.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "model/router_loss.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

using namespace fixtures;

constexpr uint64_t kSeed = 4321;
void use_router_loss(std::vector<model::MicroBatch>& batches, const model::RouterLossSettings* settings) {
  for (model::MicroBatch& b : batches) b.router_loss = settings;
}

void expect_same_loss(const model::StepLoss& got, const model::StepLoss& want) {
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.ce_sum, want.ce_sum);
  EXPECT_EQ(got.num_targets, want.num_targets);
  EXPECT_EQ(got.num_tokens, want.num_tokens);
  EXPECT_EQ(got.load_balance, want.load_balance);
  EXPECT_EQ(got.z_loss, want.z_loss);
  EXPECT_EQ(got.device_balance, want.device_balance);
}

void expect_same_grads(const model::CausalLm& got, const model::CausalLm& want) {
  for (const model::ParamSpec& spec : want.params().specs()) {
    const Tensor g = got.params().grad(spec.name), w = want.params().grad(spec.name);
    EXPECT_TRUE(bitwise_equal(g, w)) << spec.name << ": max |diff| " << testing::max_abs_diff(g, w)
                                     << ", relative error " << testing::relative_error(g, w);
  }
}

TEST(PlainExecutor, WithoutEpEqualsForwardBackwardBitwise) {
  const model::ModelConfig config = tiny_moe();
  std::vector<model::MicroBatch> batches = make_batches(3, 11, config.vocab_size, 3, 20);
  const int64_t targets = count_targets(batches);
  const model::RouterLossSettings settings = router_settings(config, targets);
  use_router_loss(batches, &settings);
  for (int64_t global : {int64_t{0}, 3 * targets}) {  // the local count, and a larger data-parallel count
    SCOPED_TRACE("global_num_targets=" + std::to_string(global));
    auto reference = make_model(config, kSeed);
    const model::StepLoss want = pipeline::forward_backward(*reference, batches, global);
    EXPECT_GT(want.load_balance, 0.0);
    EXPECT_GT(want.device_balance, 0.0);
    auto model = make_model(config, kSeed);
    PlainExecutor executor(*model, nullptr);
    expect_same_loss(executor.run_step(batches, global), want);
    expect_same_grads(*model, *reference);
  }
}

// Two steps of `model` with first writes (ParameterStore::begin_accumulation / end_accumulation, as the trainer runs
// them), every gradient holding `stale` before the first: each must give the loss `want` and the gradients of
// `reference`, a step on zeroed gradients.
void expect_first_writes_give_zeroed_steps(model::CausalLm& model, const model::CausalLm& reference,
                                           const std::vector<model::MicroBatch>& batches, const model::StepLoss& want,
                                           float stale) {
  for (Tensor& g : model.params().all_grads()) {
    g.copy_from(Tensor::from_vector(std::vector<float>(static_cast<size_t>(g.numel()), stale), g.shape()));
  }
  PlainExecutor executor(model, nullptr);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    model.params().begin_accumulation();
    expect_same_loss(executor.run_step(batches), want);
    model.params().end_accumulation();
    expect_same_grads(model, reference);
  }
}

// A step whose expert banks' gradients are left to their first writes (ParameterStore::begin_accumulation, as the
// trainer runs one) gives the bytes of a step on zeroed gradients, whatever the gradients held before: stale values
// at the first step, the previous step's sums at the second.
TEST(PlainExecutor, FirstWritesGiveTheGradientsOfAZeroedStep) {
  const model::ModelConfig config = tiny_moe();
  std::vector<model::MicroBatch> batches = make_batches(3, 17, config.vocab_size, 3, 20);
  const model::RouterLossSettings settings = router_settings(config, count_targets(batches));
  use_router_loss(batches, &settings);
  auto reference = make_model(config, kSeed);
  reference->params().zero_grads();
  const model::StepLoss want = pipeline::forward_backward(*reference, batches);
  auto model = make_model(config, kSeed);
  expect_first_writes_give_zeroed_steps(*model, *reference, batches, want, 9.0f);
}

// First writes of every family's weight GEMMs (attention and latent-attention projections, Gated DeltaNet's, routers,
// shared-expert gates, dense and shared MLPs, expert banks, the head): with every registered gradient holding NaN
// before the first step, both steps give the bytes of a step on zeroed gradients. The head materialised and fused
// (it adds chunk by chunk, so it zeroes on its first write), untied and tied (the embedding's scatter adds to a tied
// head's gradient, which is then left unregistered).
TEST(PlainExecutor, FirstWritesOfEveryFamilyGiveTheGradientsOfAZeroedStep) {
  struct Case {
    const char* config;
    int64_t head_chunk;  // 0: materialised logits
    bool tied;
  };
  for (const Case& c :
       {Case{"golden/qwen3/config.json", 0, false}, Case{"golden/qwen3/config.json", 0, true},
        Case{"golden/qwen3/config.json", 7, true}, Case{"golden/qwen3_moe/config.json", 7, false},
        Case{"golden/deepseek_v2/config.json", 0, false}, Case{"golden/gpt_oss/config.json", 0, false},
        Case{"golden/qwen3_5/config.json", 0, false}, Case{"golden/qwen3_5_moe/config.json", 5, false}}) {
    SCOPED_TRACE(::testing::Message() << c.config << ", head chunk " << c.head_chunk << (c.tied ? ", tied" : ""));
    model::ModelConfig config = model::load_model_config(testing::test_data_path(c.config));
    config.tie_word_embeddings = c.tied;
    const std::vector<model::MicroBatch> batches = make_batches(3, 17, config.vocab_size, 3, 20);
    auto reference = make_model(config, kSeed);
    reference->set_head_chunk(c.head_chunk);
    reference->params().zero_grads();
    const model::StepLoss want = pipeline::forward_backward(*reference, batches);
    auto model = make_model(config, kSeed);
    model->set_head_chunk(c.head_chunk);
    expect_first_writes_give_zeroed_steps(*model, *reference, batches, want, std::numeric_limits<float>::quiet_NaN());
  }
}

// An ep group of one still plans and runs the exchanges (all-to-all-v with itself); nothing may change.
TEST(PlainExecutor, EpOfOneEqualsForwardBackwardBitwise) {
  const model::ModelConfig config = tiny_moe();
  std::vector<model::MicroBatch> batches = make_batches(2, 12, config.vocab_size, 3, 20);
  const model::RouterLossSettings settings = router_settings(config, count_targets(batches));
  use_router_loss(batches, &settings);
  auto reference = make_model(config, kSeed);
  const model::StepLoss want = pipeline::forward_backward(*reference, batches);
  auto model = make_model(config, kSeed);
  dist::run_local_ranks(1, [&](dist::Communicator& comm) {
    PlainExecutor executor(*model, &comm);
    expect_same_loss(executor.run_step(batches), want);
  });
  expect_same_grads(*model, *reference);
}

// ep ranks as data ranks: rank r runs micro-batches of its own, of very different sizes (rank 0 long documents of 40
// to 64 tokens, the last rank documents of 2 to 3 tokens), with the global target count. After the test sums every
// gradient over the ep ranks (all_reduce), it must equal forward_backward over all the micro-batches on one rank.
//
// Tolerances. Gradients: relative error (||a - b|| / ||b||, per parameter tensor) <= 1e-5. They are not bitwise:
// an expert's weight gradient adds rows of several ranks' micro-batches in one grouped GEMM (in another order than
// one rank, micro-batch by micro-batch), and the non-expert gradients are summed per rank and then over ranks, so
// f32 additions are associated differently (differences of a few f32 ulps, ~1e-7 relative). Losses: the forward
// of each micro-batch is the same bits (the CPU kernels are batch-invariant and the exchange is a byte copy), so the
// summed ce_sum, load-balance and z-loss differ only by the order of f64 additions: relative 1e-12. Counts: exact.
TEST(PlainExecutor, ExpertParallelGradientsSumToSingleRank) {
  const model::ModelConfig config = tiny_moe();
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    std::vector<std::vector<model::MicroBatch>> per_rank;
    std::vector<model::MicroBatch> all;
    for (int r = 0; r < ep; ++r) {
      const int min_len = r == 0 ? 40 : (r == ep - 1 ? 2 : 5);
      const int max_len = r == 0 ? 64 : (r == ep - 1 ? 3 : 12);
      per_rank.push_back(
          make_batches(2, 300 + static_cast<uint64_t>(10 * ep + r), config.vocab_size, min_len, max_len));
      all.insert(all.end(), per_rank.back().begin(), per_rank.back().end());
    }
    const int64_t global = count_targets(all);
    const model::RouterLossSettings settings = router_settings(config, global);
    use_router_loss(all, &settings);
    for (auto& b : per_rank) use_router_loss(b, &settings);

    auto reference = make_model(config, kSeed);
    const model::StepLoss want = pipeline::forward_backward(*reference, all, global);

    std::vector<model::StepLoss> got(static_cast<size_t>(ep));
    std::map<std::string, Tensor> summed;
    std::mutex mu;
    dist::run_local_ranks(ep, [&](dist::Communicator& comm) {
      const int r = comm.rank();
      auto model = make_model(config, kSeed);
      PlainExecutor executor(*model, &comm);
      const model::StepLoss loss = executor.run_step(per_rank[static_cast<size_t>(r)], global);
      // Before the sum: this rank's gradients of the experts it does not own are exactly 0.
      const int64_t El = config.num_experts / ep;
      for (const model::ParamSpec& spec : model->params().specs()) {
        if (spec.name.find(".experts.") == std::string::npos) continue;
        const Tensor g = model->params().grad(spec.name);
        for (int64_t e = 0; e < config.num_experts; ++e) {
          if (e / El == r) continue;
          const Tensor slice = g.select(e);
          EXPECT_EQ(testing::max_abs_diff(slice, Tensor::zeros(slice.shape(), slice.dtype())), 0.0)
              << spec.name << " expert " << e << " on rank " << r;
        }
      }
      for (const model::ParamSpec& spec : model->params().specs())
        comm.all_reduce(Stream::cpu(), model->params().grad(spec.name), dist::ReduceOp::Sum);
      std::lock_guard lock(mu);
      got[static_cast<size_t>(r)] = loss;
      if (r == 0) {
        for (const model::ParamSpec& spec : model->params().specs())
          summed[spec.name] = model->params().grad(spec.name).clone();
      }
    });

    double ce_sum = 0.0, loss = 0.0, load_balance = 0.0, z_loss = 0.0, device_balance = 0.0;
    int64_t targets = 0, tokens = 0;
    for (const model::StepLoss& l : got) {
      ce_sum += l.ce_sum;
      loss += l.loss;
      targets += l.num_targets;
      tokens += l.num_tokens;
      load_balance += l.load_balance * static_cast<double>(l.num_tokens);  // token-weighted per rank
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
    EXPECT_GT(got.front().num_tokens, 5 * got.back().num_tokens) << "the ranks' token counts should differ a lot";

    ASSERT_EQ(summed.size(), reference->params().specs().size());
    for (const auto& [name, grad] : summed) {
      const Tensor ref = reference->params().grad(name);
      EXPECT_LE(testing::relative_error(grad, ref), 1e-5) << name;
      EXPECT_GT(testing::max_abs_diff(ref, Tensor::zeros(ref.shape(), ref.dtype())), 0.0) << name << " is all 0";
    }
  }
}

TEST(PlainExecutor, RefusesUnequalMicroBatchCountsOnEveryRank) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = make_batches(2, 13, config.vocab_size, 3, 8);
  std::vector<std::string> errors(2);
  dist::run_local_ranks(2, [&](dist::Communicator& comm) {
    auto model = make_model(config, kSeed);
    PlainExecutor executor(*model, &comm);
    const std::vector<model::MicroBatch> mine(batches.begin(), batches.begin() + (comm.rank() == 0 ? 2 : 1));
    try {
      executor.run_step(mine, 100);
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("every rank of 'world' must run the same number of micro-batches (the expert exchange is "
                           "collective); rank 0 has 2 but rank 1 has 1"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 1 has 1 but rank 0 has 2"), std::string::npos) << errors[1];
}

TEST(PlainExecutor, OneRanksBadMicroBatchStopsEveryRank) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> good = make_batches(1, 14, config.vocab_size, 3, 8);
  const int64_t T = 4;
  const std::vector<model::MicroBatch> bad = {model::MicroBatch::packed(
      Tensor::from_vector<int32_t>({1, 2, static_cast<int32_t>(config.vocab_size), 3}, {T}),
      Tensor::from_vector<int32_t>({2, 3, 4, -100}, {T}), Tensor::from_vector<int32_t>({0, 4}, {2}))};
  std::vector<std::string> errors(2);
  dist::run_local_ranks(2, [&](dist::Communicator& comm) {
    auto model = make_model(config, kSeed);
    PlainExecutor executor(*model, &comm);
    try {
      executor.run_step(comm.rank() == 1 ? bad : good, 100);
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("ep rank 1 of 'world' refused its micro-batches"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find(std::to_string(config.vocab_size)), std::string::npos) << errors[1];
}

void expect_same_logprobs(const std::vector<Tensor>& got, const std::vector<Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t m = 0; m < want.size(); ++m) {
    EXPECT_EQ(got[m].dtype(), DType::F32) << what << ", micro-batch " << m;
    EXPECT_TRUE(got[m].device().is_cpu()) << what << ", micro-batch " << m;
    EXPECT_TRUE(bitwise_equal(got[m], want[m]))
        << what << ", micro-batch " << m << ": max |diff| " << testing::max_abs_diff(got[m], want[m]);
  }
}

// The forward alone (the scoring path) is model::forward_only's forward: the same log-probs, bit for bit, and it
// touches no gradient.
TEST(PlainExecutor, RunForwardEqualsForwardOnlyLogprobsBitwise) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = make_batches(3, 15, config.vocab_size, 3, 20);
  auto model = make_model(config, kSeed);
  model::ForwardObservation observe;
  pipeline::forward_only(*model, batches, &observe);
  model->params().zero_grads();
  PlainExecutor executor(*model, nullptr);
  const std::vector<Tensor> got = executor.run_forward(batches);
  expect_same_logprobs(got, observe.token_logprobs, "no ep");
  for (size_t m = 0; m < got.size(); ++m) {
    EXPECT_EQ(got[m].shape(), (Shape{batches[m].num_tokens()}));
    const std::vector<float> lp = got[m].to_vector<float>();
    const std::vector<int32_t> targets = batches[m].targets.to_vector<int32_t>();
    for (size_t t = 0; t < lp.size(); ++t) {
      if (targets[t] == -100) {
        EXPECT_EQ(lp[t], 0.0f) << m << ", " << t;
      } else {
        EXPECT_LT(lp[t], 0.0f) << m << ", " << t;
      }
    }
  }
  for (const model::ParamSpec& spec : model->params().specs()) {
    const Tensor g = model->params().grad(spec.name);
    EXPECT_EQ(testing::max_abs_diff(g, Tensor::zeros(g.shape(), g.dtype())), 0.0) << spec.name;
  }
  EXPECT_TRUE(executor.run_forward({}).empty());
}

// With ep = 2 and 4 on thread ranks each rank's micro-batches (of very different sizes) cross the ranks for their
// experts, yet every expert row is computed by the same per-row CPU kernels: each rank's log-probs equal forward_only
// of its micro-batches on one rank, bit for bit.
TEST(PlainExecutor, ExpertParallelRunForwardEqualsForwardOnlyBitwise) {
  const model::ModelConfig config = tiny_moe();
  auto reference = make_model(config, kSeed);
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    std::vector<std::vector<model::MicroBatch>> per_rank;
    std::vector<std::vector<Tensor>> want;
    for (int r = 0; r < ep; ++r) {
      per_rank.push_back(make_batches(2, 500 + static_cast<uint64_t>(10 * ep + r), config.vocab_size, r == 0 ? 30 : 2,
                                      r == 0 ? 48 : 6));
      model::ForwardObservation observe;
      pipeline::forward_only(*reference, per_rank.back(), &observe);
      want.push_back(observe.token_logprobs);
    }
    std::vector<std::vector<Tensor>> got(static_cast<size_t>(ep));
    dist::run_local_ranks(ep, [&](dist::Communicator& comm) {
      auto model = make_model(config, kSeed);
      PlainExecutor executor(*model, &comm);
      got[static_cast<size_t>(comm.rank())] = executor.run_forward(per_rank[static_cast<size_t>(comm.rank())]);
    });
    for (int r = 0; r < ep; ++r)
      expect_same_logprobs(got[static_cast<size_t>(r)], want[static_cast<size_t>(r)], "rank " + std::to_string(r));
  }
}

TEST(PlainExecutor, RunForwardRefusesUnequalMicroBatchCountsOnEveryRank) {
  const model::ModelConfig config = tiny_moe();
  const std::vector<model::MicroBatch> batches = make_batches(2, 16, config.vocab_size, 3, 8);
  std::vector<std::string> errors(2);
  dist::run_local_ranks(2, [&](dist::Communicator& comm) {
    auto model = make_model(config, kSeed);
    PlainExecutor executor(*model, &comm);
    const std::vector<model::MicroBatch> mine(batches.begin(), batches.begin() + (comm.rank() == 0 ? 2 : 1));
    try {
      executor.run_forward(mine);
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 0 has 2 but rank 1 has 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 1 has 1 but rank 0 has 2"), std::string::npos) << errors[1];
}

TEST(PlainExecutor, RefusesEpThatDoesNotDivideTheExperts) {
  const model::ModelConfig config = tiny_moe();
  auto model = make_model(config, kSeed);
  dist::run_local_ranks(3, [&](dist::Communicator& comm) {
    try {
      PlainExecutor executor(*model, &comm);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_experts (8) is not divisible by the size of communicator 'world' (3)"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace moetrain::pipeline
