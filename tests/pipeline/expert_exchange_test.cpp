// Tests for pipeline/expert_exchange on thread ranks (in-process communicator, ep 1, 2 and 4, random top-k routing
// made by ops::make_routing_plan and rows by ops::permute_forward, as stage 1 makes them): dispatch gives the
// non-de-duplicated dist::ExpertParallelPlan's local rows bit for bit while sending one row per (token, destination)
// (a hand-computed case and an independent count), dispatch backward is dispatch's exact transpose and, after the
// token sum of stage 1's backward (ops::permute_backward), matches the plan's gradient, the combine paths are the
// plan's, the tiny MoE model's layer run through both (stage 1 -> exchange -> stage 3 -> combine -> stage 5 and back),
// the refusals, and the row reduction on a realistic routing (T 512, K 8, E 128).
#include "pipeline/expert_exchange.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "dist/expert_parallel.h"
#include "dist/inprocess_communicator.h"
#include "model/decoder_layer.h"
#include "ops/permute.h"
#include "testing/cuda_compare.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

using dist::Communicator;
using dist::ExpertParallelPlan;
using testing::expect_error;
using testing::random_tensor;
using testing::same_bytes;

// One rank's routing for one micro-batch: T tokens each choosing K distinct experts uniformly, the plan, the tokens
// x [T, H] and their expert-ordered copies (stage 1's `dispatched`).
struct Routing {
  int64_t tokens = 0, top_k = 0;
  Tensor topk_index;
  ops::RoutingPlan plan;
  Tensor x, dispatched;
};

Routing make_routing(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> topk;
  std::vector<int32_t> pool(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t k = 0; k < top_k; ++k) {  // partial Fisher-Yates: K distinct experts
      const size_t pick = static_cast<size_t>(k) + static_cast<size_t>(rng.below(static_cast<uint64_t>(experts - k)));
      std::swap(pool[static_cast<size_t>(k)], pool[pick]);
      topk.push_back(pool[static_cast<size_t>(k)]);
    }
  }
  Routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.topk_index = Tensor::from_vector(topk, {tokens, top_k});
  r.plan = ops::make_routing_plan(Stream::cpu(), r.topk_index, experts);
  r.x = random_tensor({tokens, hidden}, DType::F32, rng);
  r.dispatched = Tensor::empty({tokens * top_k, hidden}, DType::F32);
  ops::permute_forward(Stream::cpu(), r.dispatched, r.x, r.plan);
  return r;
}

uint64_t rank_seed(uint64_t seed, int rank) { return seed * 1000003 + static_cast<uint64_t>(rank); }

// Tokens per rank: uneven, and rank 1 without tokens when `rank1_empty`.
int64_t tokens_of(int rank, bool rank1_empty) { return rank1_empty && rank == 1 ? 0 : 11 + 6 * rank; }

ExpertExchange exchange_for(Communicator& comm, const Routing& r, int64_t experts) {
  return ExpertExchange::create(comm, Stream::cpu(), r.plan.expert_offsets, r.plan.row_choice, r.topk_index, experts);
}

// Unique (token, destination) pairs of a routing, counted from topk_index alone.
std::vector<int64_t> unique_pairs(const Routing& r, int ep, int64_t experts) {
  const int64_t El = experts / ep;
  const std::vector<int32_t> topk = r.topk_index.to_vector<int32_t>();
  std::vector<int64_t> count(static_cast<size_t>(ep), 0);
  for (int64_t t = 0; t < r.tokens; ++t) {
    std::vector<bool> hit(static_cast<size_t>(ep), false);
    for (int64_t k = 0; k < r.top_k; ++k)
      hit[static_cast<size_t>(topk[static_cast<size_t>(t * r.top_k + k)] / El)] = true;
    for (int q = 0; q < ep; ++q) count[static_cast<size_t>(q)] += hit[static_cast<size_t>(q)] ? 1 : 0;
  }
  return count;
}

TEST(ExpertExchange, DispatchGivesThePlansLocalRowsBitwise) {
  for (int ep : {1, 2, 4}) {
    for (bool rank1_empty : {false, true}) {
      if (ep == 1 && rank1_empty) continue;
      SCOPED_TRACE("ep=" + std::to_string(ep) + (rank1_empty ? " rank 1 without tokens" : ""));
      const int64_t E = 8, K = 3, H = 5;
      dist::run_local_ranks(ep, [&](Communicator& comm) {
        const int me = comm.rank();
        const Routing r = make_routing(tokens_of(me, rank1_empty), K, E, H, rank_seed(3, me));
        const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
        const ExpertExchange x = exchange_for(comm, r, E);
        EXPECT_EQ(x.dispatched_rows(), plan.dispatched_rows()) << "rank " << me;
        EXPECT_EQ(x.local_rows(), plan.local_rows()) << "rank " << me;
        EXPECT_TRUE(same_bytes(x.local_group_offsets(), plan.local_group_offsets())) << "rank " << me;
        const Tensor want = plan.dispatch(comm, Stream::cpu(), r.dispatched);
        const Tensor got = x.dispatch(comm, Stream::cpu(), r.dispatched);
        EXPECT_EQ(got.shape(), want.shape()) << "rank " << me;
        EXPECT_TRUE(same_bytes(got, want)) << "rank " << me << ": de-duplicated dispatch differs from the plan's";
      });
    }
  }
}

// ep 2, E 4 (rank 0 hosts experts 0-1, rank 1 experts 2-3), K 2, three tokens choosing {0, 1}, {1, 2}, {3, 2}:
// token 0 goes to rank 0 once (not twice), token 1 to both, token 2 to rank 1 once: 2 + 2 rows instead of 3 + 3.
TEST(ExpertExchange, SendsEachTokenOncePerDestinationByHand) {
  dist::run_local_ranks(2, [&](Communicator& comm) {
    Routing r;
    r.tokens = 3;
    r.top_k = 2;
    r.topk_index = Tensor::from_vector<int32_t>({0, 1, 1, 2, 3, 2}, {3, 2});
    r.plan = ops::make_routing_plan(Stream::cpu(), r.topk_index, 4);
    const ExpertExchange x = exchange_for(comm, r, 4);
    EXPECT_EQ(x.send_rows(), (std::vector<int64_t>{3, 3}));
    EXPECT_EQ(x.unique_send_rows(), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(x.unique_recv_rows(), (std::vector<int64_t>{2, 2}));  // both ranks route alike
    // Row values name their token: the receiver's local rows are token copies in (expert, source, row) order.
    // Expert-ordered rows: e0 {t0}, e1 {t0, t1}, e2 {t1, t2}, e3 {t2}.
    const Tensor rows = Tensor::from_vector<float>({0, 0, 1, 1, 2, 2}, {6, 1});
    const std::vector<float> local = x.dispatch(comm, Stream::cpu(), rows).to_vector<float>();
    if (comm.rank() == 0) {
      // e0: t0 from ranks 0 and 1; e1: t0, t1 from rank 0, then t0, t1 from rank 1.
      EXPECT_EQ(local, (std::vector<float>{0, 0, 0, 1, 0, 1}));
    } else {
      // e2: t1, t2 from rank 0, then from rank 1; e3: t2 from rank 0, then from rank 1.
      EXPECT_EQ(local, (std::vector<float>{1, 2, 1, 2, 2, 2}));
    }
  });
}

// The rows sent are the unique (token, destination) pairs, counted independently; what each rank receives is what
// the others send it; with K > ep every token has two experts on one rank, so the reduction is strict.
TEST(ExpertExchange, SendsOneRowPerUniqueTokenAndDestination) {
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    const int64_t E = 8, K = 5, H = 2;
    dist::run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      const Routing r = make_routing(tokens_of(me, false), K, E, H, rank_seed(4, me));
      const ExpertExchange x = exchange_for(comm, r, E);
      EXPECT_EQ(x.unique_send_rows(), unique_pairs(r, ep, E)) << "rank " << me;
      const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
      EXPECT_EQ(x.send_rows(), plan.send_rows()) << "rank " << me;
      const int64_t unique = std::accumulate(x.unique_send_rows().begin(), x.unique_send_rows().end(), int64_t(0));
      const int64_t rows = std::accumulate(x.send_rows().begin(), x.send_rows().end(), int64_t(0));
      EXPECT_LT(unique, rows) << "rank " << me;
      // received[p] = what rank p sends to this rank.
      Tensor mine = Tensor::from_vector(x.unique_send_rows(), {static_cast<int64_t>(ep)});
      Tensor all = Tensor::empty({static_cast<int64_t>(ep), static_cast<int64_t>(ep)}, DType::I64);
      comm.all_gather(Stream::cpu(), all, mine);
      const std::vector<int64_t> a = all.to_vector<int64_t>();
      for (int p = 0; p < ep; ++p) {
        EXPECT_EQ(x.unique_recv_rows()[static_cast<size_t>(p)], a[static_cast<size_t>(p * ep + me)])
            << "rank " << me << " from rank " << p;
      }
    });
  }
}

// Every local row's gradient goes back to its source row, as with the plan: stage 1's token sum then gives the
// same bits as without de-duplication.
TEST(ExpertExchange, DispatchBackwardIsThePlansBitwise) {
  for (int ep : {1, 2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    const int64_t E = 8, K = 4, H = 16;
    dist::run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      Rng rng(rank_seed(91, me));
      const Routing r = make_routing(tokens_of(me, false) * 3, K, E, H, rank_seed(6, me));
      const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
      const ExpertExchange x = exchange_for(comm, r, E);
      const Tensor d_local = random_tensor({x.local_rows(), H}, DType::F32, rng);
      EXPECT_TRUE(same_bytes(x.dispatch_backward(comm, Stream::cpu(), d_local),
                             plan.dispatch_backward(comm, Stream::cpu(), d_local)))
          << "rank " << me;
    });
  }
}

TEST(ExpertExchange, CombinePathsAreThePlansBitwise) {
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    const int64_t E = 8, K = 3, H = 6;
    dist::run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      Rng rng(rank_seed(17, me));
      const Routing r = make_routing(tokens_of(me, true), K, E, H, rank_seed(7, me));
      const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
      const ExpertExchange x = exchange_for(comm, r, E);
      const Tensor u = random_tensor({x.local_rows(), H}, DType::F32, rng);
      const Tensor v = random_tensor({x.dispatched_rows(), H}, DType::F32, rng);
      EXPECT_TRUE(same_bytes(x.combine(comm, Stream::cpu(), u), plan.combine(comm, Stream::cpu(), u))) << me;
      EXPECT_TRUE(same_bytes(x.combine_backward(comm, Stream::cpu(), v), plan.combine_backward(comm, Stream::cpu(), v)))
          << me;
    });
  }
}

// Without de-duplication every movement is the plan's, bit for bit, and so are the rows it sends.
TEST(ExpertExchange, WithoutDeduplicationEveryMovementIsThePlans) {
  const int64_t E = 8, K = 3, H = 6;
  dist::run_local_ranks(2, [&](Communicator& comm) {
    const int me = comm.rank();
    Rng rng(rank_seed(23, me));
    const Routing r = make_routing(tokens_of(me, true), K, E, H, rank_seed(9, me));
    const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
    const ExpertExchange x = ExpertExchange::create(comm, Stream::cpu(), r.plan.expert_offsets, r.plan.row_choice,
                                                    r.topk_index, E, /*deduplicate=*/false);
    EXPECT_EQ(x.unique_send_rows(), plan.send_rows());
    const Tensor d = random_tensor({x.dispatched_rows(), H}, DType::F32, rng);
    const Tensor l = random_tensor({x.local_rows(), H}, DType::F32, rng);
    EXPECT_TRUE(same_bytes(x.dispatch(comm, Stream::cpu(), d), plan.dispatch(comm, Stream::cpu(), d))) << me;
    EXPECT_TRUE(same_bytes(x.dispatch_backward(comm, Stream::cpu(), l), plan.dispatch_backward(comm, Stream::cpu(), l)))
        << me;
    EXPECT_TRUE(same_bytes(x.combine(comm, Stream::cpu(), l), plan.combine(comm, Stream::cpu(), l))) << me;
  });
}

TEST(ExpertExchange, RejectsBadArguments) {
  dist::run_local_ranks(2, [&](Communicator& comm) {
    const Routing r = make_routing(5, 2, 4, 3, 8);  // the same routing on both ranks: every refusal is collective
    const Tensor& offsets = r.plan.expert_offsets;
    const Tensor& choice = r.plan.row_choice;
    Stream& s = Stream::cpu();
    const Tensor& topk = r.topk_index;
    expect_error([&] { ExpertExchange::create(comm, s, offsets, choice, topk.view({-1}), 4); },
                 "expected topk_index i32 [T, K] with T * K = 10");
    expect_error([&] { ExpertExchange::create(comm, s, offsets, choice, topk, 3); },
                 "num_experts (3) must be positive and divisible by the size of communicator 'world' (2)");
    expect_error([&] { ExpertExchange::create(comm, s, offsets, choice.to(DType::I64), topk, 4); },
                 "expert exchange: row_choice");
    expect_error([&] { ExpertExchange::create(comm, s, Tensor::zeros({4}, DType::I32), choice, topk, 4); },
                 "expert exchange: group_offsets");
    expect_error([&] { ExpertExchange::create(comm, s, offsets, choice.slice(0, 9), topk.slice(0, 4), 4); },
                 "expected topk_index i32 [T, K] with T * K = 9");
    Tensor negative = choice.clone();
    negative.data<int32_t>()[3] = -2;
    expect_error([&] { ExpertExchange::create(comm, s, offsets, negative, topk, 4); },
                 "expert exchange: row_choice[3] = -2 is outside [0, T * K = 10)");

    const ExpertExchange x = exchange_for(comm, r, 4);
    expect_error(
        [&] {
          x.dispatch(comm, s, Tensor::zeros({9, 3}, DType::F32));
        },
        "expert exchange: dispatch: expected dispatched rows [10, H] (the exchange's rows); found f32[9, 3]");
    expect_error([&] { x.dispatch(comm, s, Tensor::zeros({10}, DType::F32)); }, "dispatched rows [10, H]");
    expect_error(
        [&] {
          x.combine(comm, s, Tensor::zeros({x.local_rows() + 1, 3}, DType::F32));
        },
        "combine: expected expert output rows");
    expect_error(
        [&] {
          x.dispatch_backward(comm, s, Tensor::zeros({x.local_rows() + 1, 3}, DType::F32));
        },
        "dispatch backward: expected local-row gradient");
    expect_error(
        [&] {
          ExpertExchange{}.dispatch(comm, s, Tensor::zeros({0, 3}, DType::F32));
        },
        "an exchange that was never made");
  });
}

// The tiny MoE example model's first MoE layer on each rank's own micro-batch, stage 1 -> exchange -> stage 3 ->
// combine -> stage 5 and back, once through the plan and once through the de-duplicated exchange: the forward
// output and d_hidden are bitwise the plan's (stage 3 sees the same rows; the gradients return one row per copy).
TEST(ExpertExchange, TinyMoeLayerMatchesThePlanEndToEnd) {
  const model::ModelConfig config = fixtures::tiny_moe();
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    dist::run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      const std::unique_ptr<model::CausalLm> lm = fixtures::make_model(config, 41);
      const std::vector<model::MicroBatch> batches =
          fixtures::make_batches(1, rank_seed(31, me), config.vocab_size, 8, 24);
      const model::MicroBatch& batch = batches[0];
      const model::DecoderLayer* layer = nullptr;
      for (const auto& l : lm->layers()) {
        if (layer == nullptr && l->has_experts()) layer = l.get();
      }
      ASSERT_NE(layer, nullptr);
      const Tensor hidden = lm->embed_forward(batch);
      Stream& s = Stream::cpu();
      const int64_t E = config.num_experts;
      struct Result {
        Tensor out, d_hidden;
        int64_t sent = 0;
      };
      auto run = [&](bool dedup) {
        const std::unique_ptr<model::LayerRecord> record = layer->new_record();
        const model::Dispatch o1 = layer->stage1_forward(*record, hidden, batch);
        ExpertParallelPlan plan;
        ExpertExchange x;
        Result res;
        Tensor rows, offsets;
        if (dedup) {
          x = ExpertExchange::create(comm, s, o1.group_offsets, o1.row_choice, o1.topk_index, E);
          rows = x.dispatch(comm, s, o1.rows);
          offsets = x.local_group_offsets();
          res.sent = std::accumulate(x.unique_send_rows().begin(), x.unique_send_rows().end(), int64_t(0));
        } else {
          plan = ExpertParallelPlan::create(comm, s, o1.group_offsets, E);
          rows = plan.dispatch(comm, s, o1.rows);
          offsets = plan.local_group_offsets();
          res.sent = std::accumulate(plan.send_rows().begin(), plan.send_rows().end(), int64_t(0));
        }
        Tensor expert_out = layer->stage3_forward(*record, rows, offsets);
        expert_out = dedup ? x.combine(comm, s, expert_out) : plan.combine(comm, s, expert_out);
        res.out = layer->stage5_forward(*record, expert_out);
        Rng rng(rank_seed(59, me));
        const Tensor d_out = random_tensor(res.out.shape(), res.out.dtype(), rng);
        const Tensor d_combined = layer->stage5_backward_input(*record, d_out);
        Tensor d_rows = dedup ? x.combine_backward(comm, s, d_combined) : plan.combine_backward(comm, s, d_combined);
        d_rows = layer->stage3_backward_input(*record, d_rows);
        d_rows = dedup ? x.dispatch_backward(comm, s, d_rows) : plan.dispatch_backward(comm, s, d_rows);
        res.d_hidden = layer->stage1_backward_input(*record, d_rows);
        return res;
      };
      const Result want = run(false);
      const Result got = run(true);
      EXPECT_TRUE(same_bytes(got.out, want.out)) << "rank " << me << ": the layer output differs from the plan's";
      EXPECT_TRUE(same_bytes(got.d_hidden, want.d_hidden)) << "rank " << me << ": d_hidden differs from the plan's";
      EXPECT_LE(got.sent, want.sent) << "rank " << me;
    });
  }
}

// The reduction the issue is about, on a realistic routing: T 512 tokens per rank, K 8 of E 128 experts chosen
// uniformly at random (distinct), for ep 2, 4 and 8. Prints rows sent (all ranks) by the plan and de-duplicated.
TEST(ExpertExchange, RowReductionOnRealisticRouting) {
  for (int ep : {2, 4, 8}) {
    const int64_t T = 512, K = 8, E = 128, H = 2;
    std::vector<int64_t> plan_rows(static_cast<size_t>(ep)), unique_rows(static_cast<size_t>(ep));
    dist::run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      const Routing r = make_routing(T, K, E, H, rank_seed(2026, me));
      const ExpertExchange x = exchange_for(comm, r, E);
      EXPECT_EQ(x.unique_send_rows(), unique_pairs(r, ep, E));
      // Still exact: the local rows are the plan's.
      const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), r.plan.expert_offsets, E);
      EXPECT_TRUE(
          same_bytes(x.dispatch(comm, Stream::cpu(), r.dispatched), plan.dispatch(comm, Stream::cpu(), r.dispatched)));
      plan_rows[static_cast<size_t>(me)] = std::accumulate(x.send_rows().begin(), x.send_rows().end(), int64_t(0));
      unique_rows[static_cast<size_t>(me)] =
          std::accumulate(x.unique_send_rows().begin(), x.unique_send_rows().end(), int64_t(0));
    });
    const int64_t p = std::accumulate(plan_rows.begin(), plan_rows.end(), int64_t(0));
    const int64_t u = std::accumulate(unique_rows.begin(), unique_rows.end(), int64_t(0));
    EXPECT_EQ(p, ep * T * K);
    EXPECT_LT(u, p);
    std::cout << "[ ep " << ep << ", T " << T << ", K " << K << ", E " << E << " ] dispatch rows sent: plan " << p
              << ", de-duplicated " << u << " (" << static_cast<double>(p) / static_cast<double>(u) << "x fewer)\n";
  }
}

}  // namespace
}  // namespace moetrain::pipeline
