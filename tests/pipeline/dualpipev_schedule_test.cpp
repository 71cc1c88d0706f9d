// Tests for pipeline/dualpipev_schedule: per-rank invariants (every chunk runs each micro-batch's forward and
// backward once, deferred weight gradients run once after their backward_input), the per-phase op counts of
// DualPipeV's loop bounds, and all ranks' op lists run together: once with buffered FIFO channels (messages match
// in order, every message consumed, stage-to-stage data dependencies hold) and once with dualpipev.py's batched
// rendezvous commits (no deadlock).
#include "pipeline/dualpipev_schedule.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "testing/error_message.h"

namespace moetrain::pipeline {
namespace {

using testing::expect_error;

struct Case {
  int num_ranks;
  int num_microbatches;
};

// P in {1, 2, 4, 8} with n = 2P (the minimum), 2P + 2, 3P + 1 (odd counts are allowed) and 20.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int P : {1, 2, 4, 8}) {
    std::set<int> counts = {2 * P, 2 * P + 2, 3 * P + 1};
    if (20 >= 2 * P) counts.insert(20);
    for (int n : counts) cases.push_back({P, n});
  }
  return cases;
}

std::string case_name(const Case& c) {
  return "P=" + std::to_string(c.num_ranks) + " n=" + std::to_string(c.num_microbatches);
}

std::vector<std::vector<PipelineOp>> all_ranks(const Case& c) {
  std::vector<std::vector<PipelineOp>> lists;
  for (int r = 0; r < c.num_ranks; ++r) lists.push_back(dualpipev_schedule(c.num_ranks, r, c.num_microbatches));
  return lists;
}

bool has_forward(const PipelineOp& op) { return op.kind == OpKind::Forward || op.kind == OpKind::OverlappedPair; }
bool has_backward(const PipelineOp& op) {
  return op.kind == OpKind::BackwardInput || op.kind == OpKind::BackwardFull || op.kind == OpKind::OverlappedPair;
}

// DualPipeV's loop bounds (dualpipev.py step()), written out per phase.
std::array<PhaseOpCounts, 8> expected_counts(int P, int r, int n) {
  const int down = P - r - 1;  // steps 1 (halved), 3, 5, 7
  const int up = r + 1;        // steps 2, 6, 8
  const int main = n - 2 * P + r + 1;
  std::array<PhaseOpCounts, 8> e{};
  e[0].forward = 2 * down;
  e[1].forward = 2 * up;
  e[2] = {.forward = down, .backward_input = down, .weight = down};
  if (r == P - 1) {
    e[3] = {.forward = 1, .backward_full = 1, .overlapped_pair = 2 * main - 1};
  } else {
    e[3].overlapped_pair = 2 * main;
  }
  e[4] = {.backward_full = down, .overlapped_pair = down};
  e[5] = {.backward_input = up, .backward_full = up};
  e[6] = {.backward_input = down, .weight = down};
  e[7].weight = up;
  return e;
}

TEST(Schedule, EachChunkRunsEveryMicroBatchForwardThenBackwardOnceInOrder) {
  for (const Case& c : all_cases()) {
    for (int r = 0; r < c.num_ranks; ++r) {
      SCOPED_TRACE(case_name(c) + " rank " + std::to_string(r));
      const std::vector<PipelineOp> ops = dualpipev_schedule(c.num_ranks, r, c.num_microbatches);
      std::vector<int> forwards[2], backwards[2];
      for (const PipelineOp& op : ops) {
        if (has_forward(op)) forwards[op.forward.chunk].push_back(op.forward.microbatch);
        if (has_backward(op)) {
          const ChunkWork& b = op.backward;
          const std::vector<int>& f = forwards[b.chunk];
          EXPECT_NE(std::find(f.begin(), f.end(), b.microbatch), f.end())
              << "backward before its forward: " << describe(op);
          backwards[b.chunk].push_back(b.microbatch);
        }
      }
      std::vector<int> in_order(static_cast<size_t>(c.num_microbatches));
      for (int m = 0; m < c.num_microbatches; ++m) in_order[static_cast<size_t>(m)] = m;
      for (int chunk : {0, 1}) {
        EXPECT_EQ(forwards[chunk], in_order) << "chunk " << chunk;
        EXPECT_EQ(backwards[chunk], in_order) << "chunk " << chunk;
      }
    }
  }
}

TEST(Schedule, EveryWeightGradientRunsExactlyOnceAndDeferredOnesAfterTheirBackwardInput) {
  for (const Case& c : all_cases()) {
    for (int r = 0; r < c.num_ranks; ++r) {
      SCOPED_TRACE(case_name(c) + " rank " + std::to_string(r));
      const std::vector<PipelineOp> ops = dualpipev_schedule(c.num_ranks, r, c.num_microbatches);
      std::map<std::pair<int, int>, int> weight_runs;  // (chunk, mb) -> times its weight gradient was computed
      std::deque<ChunkWork> deferred;                  // backward_input done, backward_weight not yet
      int num_deferred = 0;
      for (const PipelineOp& op : ops) {
        const std::pair<int, int> key{op.backward.chunk, op.backward.microbatch};
        switch (op.kind) {
          case OpKind::BackwardFull:
          case OpKind::OverlappedPair: ++weight_runs[key]; break;
          case OpKind::BackwardInput:
            deferred.push_back(op.backward);
            ++num_deferred;
            break;
          case OpKind::Weight:
            ASSERT_FALSE(deferred.empty()) << "weight op with nothing deferred: " << describe(op);
            EXPECT_EQ(op.backward, deferred.front()) << "weight gradients run first in, first out: " << describe(op);
            deferred.pop_front();
            ++weight_runs[key];
            break;
          case OpKind::Forward: break;
        }
      }
      EXPECT_TRUE(deferred.empty()) << deferred.size() << " deferred weight gradients never ran";
      // Deferred: P - r - 1 in step 3, r + 1 in step 6, P - r - 1 in step 7.
      EXPECT_EQ(num_deferred, 2 * c.num_ranks - r - 1);
      EXPECT_EQ(weight_runs.size(), static_cast<size_t>(2 * c.num_microbatches));
      for (const auto& [key, runs] : weight_runs) {
        EXPECT_EQ(runs, 1) << "chunk " << key.first << " mb " << key.second;
      }
    }
  }
}

TEST(Schedule, PhaseCountsMatchDualPipeVLoopBounds) {
  for (const Case& c : all_cases()) {
    for (int r = 0; r < c.num_ranks; ++r) {
      SCOPED_TRACE(case_name(c) + " rank " + std::to_string(r));
      const auto counts = count_ops_per_phase(dualpipev_schedule(c.num_ranks, r, c.num_microbatches));
      const auto expected = expected_counts(c.num_ranks, r, c.num_microbatches);
      for (size_t p = 0; p < 8; ++p) EXPECT_EQ(counts[p], expected[p]) << "phase " << p + 1;
    }
  }
}

// P = 4, n = 20, by hand from dualpipev.py: step_1 = 2(P-r-1), step_2 = r+1, step_3 = P-r-1,
// step_4 = n-2P+r+1 = 13, 14, 15, 16, step_5 = P-r-1, step_6 = r+1, step_7 = P-r-1, step_8 = r+1.
TEST(Schedule, PhaseCountsForFourRanksAndTwentyMicroBatches) {
  using C = PhaseOpCounts;  // {forward, backward_input, backward_full, weight, overlapped_pair}
  const std::array<std::array<C, 8>, 4> expected = {{
      {C{6, 0, 0, 0, 0}, C{2, 0, 0, 0, 0}, C{3, 3, 0, 3, 0}, C{0, 0, 0, 0, 26}, C{0, 0, 3, 0, 3}, C{0, 1, 1, 0, 0},
       C{0, 3, 0, 3, 0}, C{0, 0, 0, 1, 0}},
      {C{4, 0, 0, 0, 0}, C{4, 0, 0, 0, 0}, C{2, 2, 0, 2, 0}, C{0, 0, 0, 0, 28}, C{0, 0, 2, 0, 2}, C{0, 2, 2, 0, 0},
       C{0, 2, 0, 2, 0}, C{0, 0, 0, 2, 0}},
      {C{2, 0, 0, 0, 0}, C{6, 0, 0, 0, 0}, C{1, 1, 0, 1, 0}, C{0, 0, 0, 0, 30}, C{0, 0, 1, 0, 1}, C{0, 3, 3, 0, 0},
       C{0, 1, 0, 1, 0}, C{0, 0, 0, 3, 0}},
      // The last rank runs the first F0 and B1 of step 4 apart (not overlapped): 1 + 1 + 31 pairs.
      {C{0, 0, 0, 0, 0}, C{8, 0, 0, 0, 0}, C{0, 0, 0, 0, 0}, C{1, 0, 1, 0, 31}, C{0, 0, 0, 0, 0}, C{0, 4, 4, 0, 0},
       C{0, 0, 0, 0, 0}, C{0, 0, 0, 4, 0}},
  }};
  for (int r = 0; r < 4; ++r) {
    const auto counts = count_ops_per_phase(dualpipev_schedule(4, r, 20));
    int total = 0;
    for (size_t p = 0; p < 8; ++p) {
      EXPECT_EQ(counts[p], expected[static_cast<size_t>(r)][p]) << "rank " << r << " phase " << p + 1;
      total += counts[p].total();
    }
    // 2n forwards + 2n backwards, a pair counting once, plus one weight op per deferred backward (2P - r - 1).
    const int pairs = r == 3 ? 31 : 29 + r;  // step 4 pairs + step 5 pairs
    EXPECT_EQ(total, 4 * 20 - pairs + (2 * 4 - r - 1)) << "rank " << r;
  }
}

TEST(Schedule, SingleRankHoldsBothChunksSendsNothingAndStillOverlaps) {
  const std::vector<PipelineOp> ops = dualpipev_schedule(1, 0, 6);
  int pairs = 0;
  for (const PipelineOp& op : ops) {
    EXPECT_TRUE(op.recvs.empty()) << describe(op);
    EXPECT_TRUE(op.sends.empty()) << describe(op);
    if (op.kind == OpKind::OverlappedPair) {
      ++pairs;
      EXPECT_NE(op.forward.chunk, op.backward.chunk) << describe(op);
    }
  }
  // Step 4 runs n - 1 times: the first F0/B1 apart, then 2(n - 1) - 1 pairs.
  EXPECT_EQ(pairs, 2 * (6 - 1) - 1);
  ASSERT_GE(ops.size(), 3u);
  EXPECT_EQ(describe(ops[0]), "p2 F c0 mb0");
  EXPECT_EQ(describe(ops[1]), "p2 F c1 mb0");
  EXPECT_EQ(describe(ops[2]), "p4 F c0 mb1");
  EXPECT_EQ(describe(ops.back()), "p8 W c0 mb5");
}

TEST(Schedule, DescribeNamesKindChunkMicroBatchAndPeers) {
  // P = 2, rank 0: step 1 is F0 mb0, F0 mb1; step 2 is F0 mb2 (its output held back), F1 mb0 (input from rank 1,
  // after which F0 mb2's output leaves); step 3 starts with the loss stage's backward, which receives nothing.
  const std::vector<PipelineOp> ops = dualpipev_schedule(2, 0, 4);
  ASSERT_GE(ops.size(), 5u);
  EXPECT_EQ(describe(ops[0]), "p1 F c0 mb0 | send act c0 mb0 -> r1");
  EXPECT_EQ(describe(ops[2]), "p2 F c0 mb2");
  EXPECT_EQ(describe(ops[3]), "p2 F c1 mb0 | recv act c1 mb0 <- r1 | send act c0 mb2 -> r1");
  EXPECT_EQ(describe(ops[4]), "p3 B c1 mb0 (input only, W deferred) | send grad c1 mb0 -> r1");
  // Rank 1 (the bottom of the V) enters step 4 with a plain F0 then B1, then overlaps.
  const std::vector<PipelineOp> last = dualpipev_schedule(2, 1, 4);
  const auto pair = std::find_if(last.begin(), last.end(), [](const PipelineOp& op) { return op.phase == 4; });
  ASSERT_NE(pair, last.end());
  EXPECT_EQ(describe(*pair), "p4 F c0 mb2 | send act c1 mb1 -> r0");
  EXPECT_EQ(describe(*(pair + 1)), "p4 B c1 mb0 | recv grad c1 mb0 <- r0");
  EXPECT_EQ(describe(*(pair + 2)), "p4 pair F c1 mb2 & B c0 mb0 | send act c1 mb2 -> r0, grad c0 mb0 -> r0");
}

// The full trace of P = 2, n = 5 (an odd count), as DeepSeek's dualpipev.py step() emits it: obtained by running the
// reference's own control flow and send/recv helpers with torch, NCCL and the compute stubbed out, every recorded
// irecv attached to the next compute and every isend to the compute before it (phase labels added per loop).
TEST(Schedule, MatchesTheDualPipeVReferenceTraceForTwoRanksAndFiveMicroBatches) {
  const std::vector<std::vector<std::string>> reference = {
      {
          "p1 F c0 mb0 | send act c0 mb0 -> r1",
          "p1 F c0 mb1 | send act c0 mb1 -> r1",
          "p2 F c0 mb2",
          "p2 F c1 mb0 | recv act c1 mb0 <- r1 | send act c0 mb2 -> r1",
          "p3 B c1 mb0 (input only, W deferred) | send grad c1 mb0 -> r1",
          "p3 W c1 mb0 | recv act c1 mb1 <- r1",
          "p3 F c1 mb1",
          "p4 pair F c0 mb3 & B c1 mb1 | send act c0 mb3 -> r1, grad c1 mb1 -> r1",
          "p4 pair F c1 mb2 & B c0 mb0 | recv act c1 mb2 <- r1, grad c0 mb0 <- r1",
          "p4 pair F c0 mb4 & B c1 mb2 | send act c0 mb4 -> r1, grad c1 mb2 -> r1",
          "p4 pair F c1 mb3 & B c0 mb1 | recv act c1 mb3 <- r1, grad c0 mb1 <- r1",
          "p5 B c1 mb3 | send grad c1 mb3 -> r1",
          "p5 pair F c1 mb4 & B c0 mb2 | recv act c1 mb4 <- r1, grad c0 mb2 <- r1",
          "p6 B c1 mb4 | send grad c1 mb4 -> r1",
          "p6 B c0 mb3 (input only, W deferred) | recv grad c0 mb3 <- r1",
          "p7 W c0 mb3",
          "p7 B c0 mb4 (input only, W deferred) | recv grad c0 mb4 <- r1",
          "p8 W c0 mb4",
      },
      {
          "p2 F c0 mb0 | recv act c0 mb0 <- r0",
          "p2 F c1 mb0 | recv act c0 mb1 <- r0 | send act c1 mb0 -> r0",
          "p2 F c0 mb1",
          "p2 F c1 mb1 | recv act c0 mb2 <- r0",
          "p4 F c0 mb2 | send act c1 mb1 -> r0",
          "p4 B c1 mb0 | recv grad c1 mb0 <- r0",
          "p4 pair F c1 mb2 & B c0 mb0 | send act c1 mb2 -> r0, grad c0 mb0 -> r0",
          "p4 pair F c0 mb3 & B c1 mb1 | recv act c0 mb3 <- r0, grad c1 mb1 <- r0",
          "p4 pair F c1 mb3 & B c0 mb1 | send act c1 mb3 -> r0, grad c0 mb1 -> r0",
          "p4 pair F c0 mb4 & B c1 mb2 | recv act c0 mb4 <- r0, grad c1 mb2 <- r0",
          "p4 pair F c1 mb4 & B c0 mb2 | send act c1 mb4 -> r0, grad c0 mb2 -> r0",
          "p6 B c1 mb3 | recv grad c1 mb3 <- r0",
          "p6 B c0 mb3 | send grad c0 mb3 -> r0",
          "p6 B c1 mb4 (input only, W deferred) | recv grad c1 mb4 <- r0",
          "p6 B c0 mb4 (input only, W deferred) | send grad c0 mb4 -> r0",
          "p8 W c1 mb4",
          "p8 W c0 mb4",
      }};
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> lines;
    for (const PipelineOp& op : dualpipev_schedule(2, r, 5)) lines.push_back(describe(op));
    EXPECT_EQ(lines, reference[static_cast<size_t>(r)]) << "rank " << r;
  }
}

TEST(Schedule, RefusesTooFewMicroBatchesNoRanksAndRankOutOfRange) {
  expect_error([] { dualpipev_schedule(4, 0, 7); }, {"num_microbatches >= 2 * num_ranks = 8", "found 7"});
  expect_error([] { dualpipev_schedule(1, 0, 1); }, {"num_microbatches >= 2 * num_ranks = 2", "found 1"});
  expect_error([] { dualpipev_schedule(0, 0, 8); }, {"num_ranks", "must be >= 1, found 0"});
  expect_error([] { dualpipev_schedule(-2, 0, 8); }, {"num_ranks", "found -2"});
  expect_error([] { dualpipev_schedule(4, 4, 8); }, {"rank must be in [0, 4)", "found 4"});
  expect_error([] { dualpipev_schedule(4, -1, 8); }, {"rank must be in [0, 4)", "found -1"});
}

TEST(Schedule, StageOfEachChunkFollowsTheV) {
  EXPECT_EQ(dualpipev_stage(4, 0, 0), 0);
  EXPECT_EQ(dualpipev_stage(4, 0, 1), 7);
  EXPECT_EQ(dualpipev_stage(4, 3, 0), 3);
  EXPECT_EQ(dualpipev_stage(4, 3, 1), 4);
  EXPECT_EQ(dualpipev_stage(1, 0, 1), 1);
  EXPECT_TRUE(dualpipev_is_loss_chunk(0, 1));
  EXPECT_FALSE(dualpipev_is_loss_chunk(0, 0));
  EXPECT_FALSE(dualpipev_is_loss_chunk(1, 1));
  expect_error([] { dualpipev_stage(4, 0, 2); }, {"chunk 0 or 1", "chunk 2"});
}

// ---- all ranks together ----

// The rank that sends `kind` data of `chunk` to `rank` (-1 when the hand-off is local or there is none).
int expected_source(int P, int rank, TransferKind kind, int chunk) {
  const bool down = (kind == TransferKind::Activation) == (chunk == 0);  // towards higher ranks
  const int source = down ? rank - 1 : rank + 1;
  return source >= 0 && source < P ? source : -1;
}

// Executes every rank's list with unbounded FIFO channels per (source, destination): a rank runs its next op once
// that op's receives are at the heads of their channels; sends are pushed right after the compute. Checks every
// message against what the receiver expects, local data availability, and the global order of stages.
void simulate_buffered(const Case& c) {
  SCOPED_TRACE(case_name(c));
  const int P = c.num_ranks, n = c.num_microbatches;
  const auto lists = all_ranks(c);
  std::map<std::pair<int, int>, std::deque<Transfer>> channels;  // (src, dst) -> messages; Transfer.peer = src
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  // Per rank: what it holds. Keys are (chunk, mb).
  const size_t num_ranks = static_cast<size_t>(P);
  std::vector<std::set<std::pair<int, int>>> fwd_done(num_ranks), bwd_done(num_ranks), act_in(num_ranks),
      grad_in(num_ranks);
  // Global logical time of each stage's forward / backward of each micro-batch.
  std::vector<std::vector<long>> t_fwd(size_t(2 * P), std::vector<long>(size_t(n), -1));
  auto t_bwd = t_fwd;
  long clock = 0;

  auto ready = [&](int r) {
    const PipelineOp& op = lists[size_t(r)][next[size_t(r)]];
    std::map<int, size_t> used;  // messages this op takes from each source so far
    for (const Transfer& t : op.recvs) {
      const auto it = channels.find({t.peer, r});
      const size_t position = used[t.peer]++;
      if (it == channels.end() || it->second.size() <= position) return false;
    }
    return true;
  };

  auto run = [&](int r) {
    const PipelineOp& op = lists[size_t(r)][next[size_t(r)]++];
    const std::string where = "rank " + std::to_string(r) + " op '" + describe(op) + "'";
    for (const Transfer& t : op.recvs) {
      ASSERT_EQ(t.peer, expected_source(P, r, t.kind, t.chunk)) << where << ": wrong source for " << describe(t);
      std::deque<Transfer>& ch = channels[{t.peer, r}];
      const Transfer got = ch.front();
      ch.pop_front();
      ASSERT_EQ(got, (Transfer{t.kind, t.peer, t.chunk, t.microbatch}))
          << where << ": expected " << describe(t) << " from rank " << t.peer << ", the channel delivered "
          << describe(got);
      (t.kind == TransferKind::Activation ? act_in : grad_in)[size_t(r)].insert({t.chunk, t.microbatch});
    }
    ++clock;
    if (has_forward(op)) {
      const auto key = std::make_pair(op.forward.chunk, op.forward.microbatch);
      const int stage = dualpipev_stage(P, r, key.first);
      if (stage == 0) {
        // the first stage reads the micro-batch's tokens
      } else if (r == P - 1 && key.first == 1) {
        EXPECT_TRUE(fwd_done[size_t(r)].count({0, key.second})) << where << ": chunk 0's output not computed";
      } else {
        EXPECT_TRUE(act_in[size_t(r)].count(key)) << where << ": input activation not received";
      }
      EXPECT_TRUE(fwd_done[size_t(r)].insert(key).second) << where << ": forward ran twice";
      t_fwd[size_t(stage)][size_t(key.second)] = clock;
    }
    if (has_backward(op)) {
      const auto key = std::make_pair(op.backward.chunk, op.backward.microbatch);
      const int stage = dualpipev_stage(P, r, key.first);
      EXPECT_TRUE(fwd_done[size_t(r)].count(key)) << where << ": backward before forward";
      if (dualpipev_is_loss_chunk(r, key.first)) {
        // starts from the loss of its own forward
      } else if (r == P - 1 && key.first == 0) {
        EXPECT_TRUE(bwd_done[size_t(r)].count({1, key.second})) << where << ": chunk 1's input gradient missing";
      } else {
        EXPECT_TRUE(grad_in[size_t(r)].count(key)) << where << ": output gradient not received";
      }
      EXPECT_TRUE(bwd_done[size_t(r)].insert(key).second) << where << ": backward ran twice";
      t_bwd[size_t(stage)][size_t(key.second)] = clock;
    }
    for (const Transfer& t : op.sends) {
      const auto key = std::make_pair(t.chunk, t.microbatch);
      if (t.kind == TransferKind::Activation) {
        EXPECT_TRUE(fwd_done[size_t(r)].count(key)) << where << ": sends an activation not yet computed";
      } else {
        EXPECT_TRUE(bwd_done[size_t(r)].count(key)) << where << ": sends a gradient not yet computed";
      }
      EXPECT_EQ(expected_source(P, t.peer, t.kind, t.chunk), r) << where << ": wrong destination for " << describe(t);
      channels[{r, t.peer}].push_back({t.kind, r, t.chunk, t.microbatch});
    }
  };

  for (;;) {
    bool all_done = true, progressed = false;
    for (int r = 0; r < P; ++r) {
      if (next[size_t(r)] == lists[size_t(r)].size()) continue;
      all_done = false;
      if (ready(r)) {
        run(r);
        if (::testing::Test::HasFatalFailure()) return;
        progressed = true;
      }
    }
    if (all_done) break;
    if (!progressed) {
      std::string stuck;
      for (int r = 0; r < P; ++r) {
        if (next[size_t(r)] < lists[size_t(r)].size()) {
          stuck += "\n  rank " + std::to_string(r) + " waits at '" + describe(lists[size_t(r)][next[size_t(r)]]) + "'";
        }
      }
      FAIL() << "deadlock:" << stuck;
    }
  }
  for (const auto& [pair, ch] : channels) {
    EXPECT_TRUE(ch.empty()) << ch.size() << " messages from rank " << pair.first << " to rank " << pair.second
                            << " never received, first " << describe(ch.front());
  }
  // Stage order: stage s forwards mb m after stage s-1 did; backward runs from the last stage down to stage 0.
  for (int m = 0; m < n; ++m) {
    for (int s = 0; s < 2 * P; ++s) {
      ASSERT_GT(t_fwd[size_t(s)][size_t(m)], 0) << "stage " << s << " mb " << m << " never ran forward";
      ASSERT_GT(t_bwd[size_t(s)][size_t(m)], 0) << "stage " << s << " mb " << m << " never ran backward";
      if (s > 0) {
        EXPECT_GT(t_fwd[size_t(s)][size_t(m)], t_fwd[size_t(s) - 1][size_t(m)]) << "stage " << s << " mb " << m;
      }
      if (s + 1 < 2 * P) {
        EXPECT_GT(t_bwd[size_t(s)][size_t(m)], t_bwd[size_t(s) + 1][size_t(m)]) << "stage " << s << " mb " << m;
      }
    }
    EXPECT_GT(t_bwd[size_t(2 * P - 1)][size_t(m)], t_fwd[size_t(2 * P - 1)][size_t(m)]) << "loss stage mb " << m;
  }
}

TEST(ScheduleSimulation, AllRanksCompleteWithFifoChannelsMatchingMessagesAndStageOrder) {
  for (const Case& c : all_cases()) {
    simulate_buffered(c);
    if (HasFatalFailure()) return;
  }
}

// dualpipev.py's own communication model: before op k a rank posts op k-1's sends and op k's receives as one
// batch_isend_irecv and waits for all of it; a send completes only once its receiver has posted the matching
// receive (NCCL may rendezvous), a receive once its sender has posted the send. Checks the lists cannot deadlock.
void simulate_rendezvous(const Case& c) {
  SCOPED_TRACE(case_name(c));
  const int P = c.num_ranks;
  const auto lists = all_ranks(c);
  struct Item {
    bool is_send;
    int peer;
    size_t index;  // position among the messages of this (source, destination) pair
  };
  // batches[r][k]: what rank r waits on before op k (k == ops.size(): the final commit).
  std::vector<std::vector<std::vector<Item>>> batches(static_cast<size_t>(P));
  // batch_of[(src, dst)]: for each message in order, the batch index at the sender and at the receiver.
  std::map<std::pair<int, int>, std::vector<size_t>> send_batch, recv_batch;
  std::map<std::pair<int, int>, std::vector<Transfer>> sent, received;
  for (int r = 0; r < P; ++r) {
    const auto& ops = lists[size_t(r)];
    auto& rb = batches[size_t(r)];
    rb.resize(ops.size() + 1);
    for (size_t k = 0; k <= ops.size(); ++k) {
      if (k > 0) {
        for (const Transfer& t : ops[k - 1].sends) {
          auto& v = send_batch[{r, t.peer}];
          rb[k].push_back({true, t.peer, v.size()});
          v.push_back(k);
          sent[{r, t.peer}].push_back({t.kind, r, t.chunk, t.microbatch});
        }
      }
      if (k < ops.size()) {
        for (const Transfer& t : ops[k].recvs) {
          auto& v = recv_batch[{t.peer, r}];
          rb[k].push_back({false, t.peer, v.size()});
          v.push_back(k);
          received[{t.peer, r}].push_back({t.kind, t.peer, t.chunk, t.microbatch});
        }
      }
    }
  }
  ASSERT_EQ(sent, received) << "the messages sent and the messages expected differ";
  std::vector<size_t> current(size_t(P), 0);  // the batch each rank has posted and waits on
  auto complete = [&](int r) {
    for (const Item& it : batches[size_t(r)][current[size_t(r)]]) {
      const int other = it.peer;
      const size_t other_batch = it.is_send ? recv_batch[{r, other}][it.index] : send_batch[{other, r}][it.index];
      if (current[size_t(other)] < other_batch) return false;
    }
    return true;
  };
  for (;;) {
    bool all_done = true, progressed = false;
    for (int r = 0; r < P; ++r) {
      if (current[size_t(r)] == batches[size_t(r)].size()) continue;
      all_done = false;
      if (complete(r)) {
        ++current[size_t(r)];
        progressed = true;
      }
    }
    if (all_done) return;
    if (!progressed) {
      std::string stuck;
      for (int r = 0; r < P; ++r) {
        const size_t k = current[size_t(r)];
        if (k == batches[size_t(r)].size()) continue;
        stuck += "\n  rank " + std::to_string(r) + " at commit " + std::to_string(k) +
                 (k < lists[size_t(r)].size() ? " before '" + describe(lists[size_t(r)][k]) + "'" : " (final)");
      }
      FAIL() << "deadlock under batched rendezvous commits:" << stuck;
    }
  }
}

TEST(ScheduleSimulation, CompletesUnderDualPipeVBatchedRendezvousCommits) {
  for (const Case& c : all_cases()) {
    simulate_rendezvous(c);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace moetrain::pipeline
