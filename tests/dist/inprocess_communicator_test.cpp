// Tests for dist/inprocess_communicator: every collective on thread ranks (worlds 1-4) with exact
// values, rank-order determinism, all_to_all_v, send/recv groups, split, and the fail-closed
// paths: a failing rank aborts the world, the watchdog timeout, mismatched calls.
#include "dist/inprocess_communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "testing/error_message.h"

namespace moetrain::dist {
namespace {

using testing::expect_error;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

Stream& cpu() { return Stream::cpu(); }

// Runs fn on thread ranks and returns the error message of the run ("" when it succeeded).
std::string run_expecting_error(int n, const std::function<void(Communicator&)>& fn, LocalWorldOptions options) {
  try {
    run_local_ranks(n, fn, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Collects per-rank error messages from inside the ranks.
struct Messages {
  std::mutex mu;
  std::vector<std::string> by_rank;
  explicit Messages(int n) : by_rank(n) {}
  template <typename Fn>
  void capture(int rank, Fn&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      std::lock_guard lock(mu);
      by_rank[rank] = e.what();
      throw;
    }
  }
};

class WorldSizes : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(InProcess, WorldSizes, ::testing::Values(1, 2, 3, 4));

TEST_P(WorldSizes, AllReduceSumAndMaxGiveExactValues) {
  const int n = GetParam();
  run_local_ranks(n, [n](Communicator& c) {
    const int r = c.rank();
    Tensor f = Tensor::from_vector<float>({1.0f * r, 2.0f + r, -3.0f * r}, {3});
    c.all_reduce(cpu(), f, ReduceOp::Sum);
    const float s = n * (n - 1) / 2.0f;
    EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{s, 2.0f * n + s, -3.0f * s}));

    Tensor d = Tensor::from_vector<double>({0.5 * r, -1.0 * r}, {2});
    c.all_reduce(cpu(), d, ReduceOp::Max);
    EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{0.5 * (n - 1), 0.0}));

    Tensor i32 = Tensor::from_vector<int32_t>({r, 10}, {2});
    c.all_reduce(cpu(), i32, ReduceOp::Sum);
    EXPECT_EQ(i32.to_vector<int32_t>(), (std::vector<int32_t>{n * (n - 1) / 2, 10 * n}));

    Tensor i64 = Tensor::from_vector<int64_t>({int64_t{1} << 40, -r}, {2});
    c.all_reduce(cpu(), i64, ReduceOp::Max);
    EXPECT_EQ(i64.to_vector<int64_t>(), (std::vector<int64_t>{int64_t{1} << 40, 0}));
  });
}

TEST_P(WorldSizes, AllGatherConcatenatesInRankOrder) {
  const int n = GetParam();
  run_local_ranks(n, [n](Communicator& c) {
    Tensor in = Tensor::from_vector<int32_t>({c.rank() * 10, c.rank() * 10 + 1}, {1, 2});
    Tensor out = Tensor::zeros({n, 2}, DType::I32);
    c.all_gather(cpu(), out, in);
    std::vector<int32_t> expected;
    for (int r = 0; r < n; ++r) expected.insert(expected.end(), {r * 10, r * 10 + 1});
    EXPECT_EQ(out.to_vector<int32_t>(), expected);
  });
}

TEST_P(WorldSizes, ReduceScatterGivesEachRankItsChunk) {
  const int n = GetParam();
  run_local_ranks(n, [n](Communicator& c) {
    // Rank r contributes in[j] = r * 100 + j for j in [0, 2n).
    std::vector<float> values;
    for (int j = 0; j < 2 * n; ++j) values.push_back(static_cast<float>(c.rank() * 100 + j));
    Tensor in = Tensor::from_vector<float>(values, {2 * n});
    Tensor out = Tensor::zeros({2}, DType::F32);
    c.reduce_scatter(cpu(), out, in, ReduceOp::Sum);
    const float rank_sum = 100.0f * n * (n - 1) / 2.0f;
    const int j0 = 2 * c.rank();
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{rank_sum + n * j0, rank_sum + n * (j0 + 1)}));

    Tensor in_max = Tensor::from_vector<float>(values, {2 * n});
    c.reduce_scatter(cpu(), out, in_max, ReduceOp::Max);
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{100.0f * (n - 1) + j0, 100.0f * (n - 1) + j0 + 1}));
  });
}

TEST_P(WorldSizes, BroadcastCopiesTheRootsData) {
  const int n = GetParam();
  run_local_ranks(n, [n](Communicator& c) {
    const int root = n - 1;
    Tensor t = Tensor::from_vector<int64_t>({c.rank(), c.rank() * 2, 7}, {3});
    c.broadcast(cpu(), t, root);
    EXPECT_EQ(t.to_vector<int64_t>(), (std::vector<int64_t>{root, root * 2, 7}));
  });
}

TEST_P(WorldSizes, BarrierAndRingSendRecv) {
  const int n = GetParam();
  run_local_ranks(n, [n](Communicator& c) {
    c.barrier(cpu());
    const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    // Sends are buffered, so a ring of plain send-then-recv cannot deadlock.
    c.send(cpu(), Tensor::from_vector<float>({1.5f * c.rank()}, {1}), next);
    Tensor got = Tensor::zeros({1}, DType::F32);
    c.recv(cpu(), got, prev);
    EXPECT_EQ(got.item<float>(), 1.5f * prev);
    c.barrier(cpu());
  });
}

TEST_P(WorldSizes, AllToAllVRoutesRowsIncludingZeroRowPeers) {
  const int n = GetParam();
  // Rank s sends rows(s, d) = (s + 2 * d) % 3 rows to rank d: some pairs send none.
  const auto rows = [](int s, int d) { return static_cast<int64_t>((s + 2 * d) % 3); };
  run_local_ranks(n, [n, rows](Communicator& c) {
    const int me = c.rank();
    std::vector<int64_t> send_rows(n), recv_rows(n);
    int64_t total_send = 0, total_recv = 0;
    for (int p = 0; p < n; ++p) {
      send_rows[p] = rows(me, p);
      recv_rows[p] = rows(p, me);
      total_send += send_rows[p];
      total_recv += recv_rows[p];
    }
    // Row k of rank s's input sent to d carries (s, d, k) as s * 100 + d * 10 + k, twice.
    std::vector<int32_t> in_values;
    for (int d = 0; d < n; ++d) {
      for (int64_t k = 0; k < send_rows[d]; ++k) {
        const int32_t v = me * 100 + d * 10 + static_cast<int32_t>(k);
        in_values.insert(in_values.end(), {v, -v});
      }
    }
    Tensor in = Tensor::from_vector<int32_t>(in_values, {total_send, 2});
    Tensor out = Tensor::zeros({total_recv, 2}, DType::I32);
    c.all_to_all_v(cpu(), out, recv_rows, in, send_rows);
    std::vector<int32_t> expected;
    for (int s = 0; s < n; ++s) {
      for (int64_t k = 0; k < recv_rows[s]; ++k) {
        const int32_t v = s * 100 + me * 10 + static_cast<int32_t>(k);
        expected.insert(expected.end(), {v, -v});
      }
    }
    EXPECT_EQ(out.to_vector<int32_t>(), expected);
  });
}

TEST(InProcessCommunicator, SumsInRankOrderWhateverTheArrivalOrder) {
  // In f32, 1e8 + 1 - 1e8 + 1 depends on the order: rank order gives ((1e8 + 1) - 1e8) + 1 = 1.
  const std::vector<float> contribution = {1e8f, 1.0f, -1e8f, 1.0f};
  float expected = contribution[0];
  for (int r = 1; r < 4; ++r) expected += contribution[r];
  for (int trial = 0; trial < 4; ++trial) {
    std::mutex mu;
    std::vector<uint32_t> bits;
    run_local_ranks(4, [&](Communicator& c) {
      // A different rank arrives first in each trial.
      std::this_thread::sleep_for(std::chrono::milliseconds(((c.rank() + trial) % 4) * 5));
      Tensor t = Tensor::from_vector<float>({contribution[c.rank()]}, {1});
      c.all_reduce(cpu(), t, ReduceOp::Sum);
      uint32_t b;
      const float v = t.item<float>();
      std::memcpy(&b, &v, 4);
      std::lock_guard lock(mu);
      bits.push_back(b);
    });
    uint32_t expected_bits;
    std::memcpy(&expected_bits, &expected, 4);
    for (uint32_t b : bits) EXPECT_EQ(b, expected_bits) << "trial " << trial;
  }
}

TEST(InProcessCommunicator, Bf16SumsAccumulateInF32AndRoundOnce) {
  // 256 + 1 + 1: stepwise bf16 rounding would give 256 (257 rounds to even); f32 gives 258.
  run_local_ranks(3, [](Communicator& c) {
    const float v = c.rank() == 0 ? 256.0f : 1.0f;
    Tensor t = Tensor::from_vector<float>({v}, {1}).to(DType::BF16);
    c.all_reduce(cpu(), t, ReduceOp::Sum);
    EXPECT_EQ(t.to(DType::F32).item<float>(), 258.0f);
  });
}

TEST(InProcessCommunicator, EmptyTensorsPassThroughEveryOp) {
  run_local_ranks(2, [](Communicator& c) {
    Tensor empty = Tensor::zeros({0, 3}, DType::F32);
    c.all_reduce(cpu(), empty, ReduceOp::Sum);
    c.all_gather(cpu(), Tensor::zeros({0, 3}, DType::F32), empty);
    c.reduce_scatter(cpu(), Tensor::zeros({0}, DType::F32), empty, ReduceOp::Max);
    c.broadcast(cpu(), empty, 0);
    c.all_to_all_v(cpu(), Tensor::zeros({0, 3}, DType::F32), {0, 0}, empty, {0, 0});
    c.send(cpu(), empty, 1 - c.rank());
    c.recv(cpu(), empty, 1 - c.rank());
    EXPECT_EQ(empty.numel(), 0);
  });
}

TEST(InProcessCommunicator, GroupedPairwiseExchangeDoesNotDeadlock) {
  run_local_ranks(2, [](Communicator& c) {
    const int peer = 1 - c.rank();
    Tensor got = Tensor::zeros({2}, DType::F64);
    // Both ranks post the receive first; inside a group it waits until group_end.
    c.group_start();
    c.recv(cpu(), got, peer);
    c.send(cpu(), Tensor::from_vector<double>({1.0 + c.rank(), 2.0}, {2}), peer);
    c.group_end();
    EXPECT_EQ(got.to_vector<double>(), (std::vector<double>{1.0 + peer, 2.0}));
  });
}

TEST(InProcessCommunicator, SplitGroupsByColorOrderedByKey) {
  run_local_ranks(4, [](Communicator& world) {
    const int r = world.rank();
    // Even and odd ranks; key -r reverses the order inside each group.
    std::unique_ptr<Communicator> half = world.split(r % 2, -r, "half");
    ASSERT_NE(half, nullptr);
    EXPECT_EQ(half->name(), "half");
    EXPECT_EQ(half->size(), 2);
    EXPECT_EQ(half->rank(), r < 2 ? 1 : 0);
    Tensor in = Tensor::from_vector<int32_t>({r}, {1});
    Tensor out = Tensor::zeros({2}, DType::I32);
    half->all_gather(cpu(), out, in);
    EXPECT_EQ(out.to_vector<int32_t>(), r % 2 == 0 ? (std::vector<int32_t>{2, 0}) : (std::vector<int32_t>{3, 1}));
    // Splits of splits, and the parent keeps working alongside.
    std::unique_ptr<Communicator> single = half->split(half->rank(), 0, "single");
    EXPECT_EQ(single->size(), 1);
    Tensor s = Tensor::from_vector<int32_t>({r}, {1});
    world.all_reduce(cpu(), s, ReduceOp::Sum);
    EXPECT_EQ(s.item<int32_t>(), 6);
    // A negative color joins no group.
    std::unique_ptr<Communicator> some = world.split(r == 3 ? -1 : 0, r, "some");
    EXPECT_EQ(some == nullptr, r == 3);
    if (some) {
      EXPECT_EQ(some->size(), 3);
    }
  });
}

TEST(InProcessCommunicator, FailingRankAbortsTheWorldQuickly) {
  Messages messages(3);
  const auto start = Clock::now();
  const std::string error = run_expecting_error(
      3,
      [&](Communicator& c) {
        if (c.rank() == 1) throw Error("boom on rank 1");
        if (c.rank() == 2) std::this_thread::sleep_for(100ms);  // enters after the abort
        messages.capture(c.rank(), [&] {
          Tensor t = Tensor::zeros({4}, DType::F32);
          c.all_reduce(cpu(), t, ReduceOp::Sum);
        });
      },
      LocalWorldOptions{10s});
  EXPECT_LT(Clock::now() - start, 5s);  // the abort, not the 10 s watchdog
  EXPECT_EQ(error, "boom on rank 1");   // the first failure is rethrown
  for (int r : {0, 2}) {
    EXPECT_NE(messages.by_rank[r].find("rank 1 failed (boom on rank 1)"), std::string::npos) << messages.by_rank[r];
    EXPECT_NE(messages.by_rank[r].find(fmt::format("rank {} waited in all_reduce on 'world'", r)), std::string::npos)
        << messages.by_rank[r];
  }
}

TEST(InProcessCommunicator, TimeoutNamesTheOpAndTheMissingRank) {
  Messages messages(3);
  const auto start = Clock::now();
  const std::string error = run_expecting_error(
      3,
      [&](Communicator& c) {
        if (c.rank() == 2) std::this_thread::sleep_for(1000ms);
        messages.capture(c.rank(), [&] {
          Tensor t = Tensor::zeros({4}, DType::F32);
          c.all_reduce(cpu(), t, ReduceOp::Sum);
        });
      },
      LocalWorldOptions{500ms});
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_NE(error.find("timeout after 0.5 s in all_reduce"), std::string::npos) << error;
  EXPECT_NE(error.find("on 'world'"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 2 did not arrive"), std::string::npos) << error;
  // The late rank learns why the world is gone when it finally arrives.
  EXPECT_NE(messages.by_rank[2].find("failed (dist: timeout"), std::string::npos) << messages.by_rank[2];
}

TEST(InProcessCommunicator, RankThatFinishesWithoutCallingIsNamedAtOnce) {
  const auto start = Clock::now();
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        if (c.rank() == 1) return;
        c.barrier(cpu());
      },
      LocalWorldOptions{10s});
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_NE(error.find("rank 1 finished without calling barrier"), std::string::npos) << error;
}

TEST(InProcessCommunicator, TimeoutInRecvNamesTheSender) {
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        if (c.rank() == 0) {
          Tensor t = Tensor::zeros({1}, DType::F32);
          c.recv(cpu(), t, 1);
        } else {
          std::this_thread::sleep_for(800ms);
        }
      },
      LocalWorldOptions{300ms});
  EXPECT_NE(error.find("timeout after 0.3 s in recv on 'world' at rank 0: rank 1 did not send"), std::string::npos)
      << error;
}

TEST(InProcessCommunicator, MismatchedOpsAreNamed) {
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        Tensor t = Tensor::zeros({4}, DType::F32);
        if (c.rank() == 0) std::this_thread::sleep_for(50ms);  // rank 1 arrives first
        if (c.rank() == 0) {
          c.all_reduce(cpu(), t, ReduceOp::Sum);
        } else {
          Tensor out = Tensor::zeros({8}, DType::F32);
          c.all_gather(cpu(), out, t);
        }
      },
      LocalWorldOptions{10s});
  EXPECT_NE(error.find("mismatched calls at call #0 on 'world': rank 1 called all_gather (4 x f32 per rank) but rank "
                       "0 called all_reduce (sum of 4 x f32)"),
            std::string::npos)
      << error;
}

TEST(InProcessCommunicator, MismatchedCountsAreNamed) {
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        if (c.rank() == 1) std::this_thread::sleep_for(50ms);
        Tensor t = Tensor::zeros({c.rank() == 0 ? 4 : 6}, DType::F32);
        c.all_reduce(cpu(), t, ReduceOp::Sum);
      },
      LocalWorldOptions{10s});
  EXPECT_NE(error.find("rank 0 called all_reduce (sum of 4 x f32) but rank 1 called all_reduce (sum of 6 x f32)"),
            std::string::npos)
      << error;
}

TEST(InProcessCommunicator, AllToAllVRejectsRowCountsThePeersDisagreeOn) {
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        // Rank 0 sends 2 rows to rank 1, but rank 1 expects only 1.
        const std::vector<int64_t> send = c.rank() == 0 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{0, 0};
        const std::vector<int64_t> recv = c.rank() == 0 ? std::vector<int64_t>{0, 0} : std::vector<int64_t>{1, 0};
        Tensor in = Tensor::zeros({send[0] + send[1], 3}, DType::F32);
        Tensor out = Tensor::zeros({recv[0] + recv[1], 3}, DType::F32);
        c.all_to_all_v(cpu(), out, recv, in, send);
      },
      LocalWorldOptions{10s});
  EXPECT_NE(error.find("rank 0 sends 2 rows to rank 1 but rank 1 expects 1 rows from rank 0"), std::string::npos)
      << error;
}

TEST(InProcessCommunicator, RecvRejectsAMessageOfAnotherShape) {
  const std::string error = run_expecting_error(
      2,
      [](Communicator& c) {
        if (c.rank() == 0) {
          c.send(cpu(), Tensor::zeros({3}, DType::F32), 1);
        } else {
          Tensor t = Tensor::zeros({4}, DType::F32);
          c.recv(cpu(), t, 0);
        }
      },
      LocalWorldOptions{10s});
  EXPECT_NE(error.find("rank 1 expects 4 x f32 from rank 0 but it sent 3 x f32"), std::string::npos) << error;
}

TEST(InProcessCommunicator, RejectsBadArgumentsBeforeCommunicating) {
  run_local_ranks(2, [](Communicator& c) {
    Tensor f4 = Tensor::zeros({4}, DType::F32);
    Tensor f3 = Tensor::zeros({3}, DType::F32);
    expect_error([&] { c.all_gather(cpu(), f4, f3); }, "out must hold size (2) x in (f32[3] on cpu) = 6 elements");
    expect_error([&] { c.reduce_scatter(cpu(), f3, f4, ReduceOp::Sum); },
                 "in must hold size (2) x out (f32[3] on cpu) = 6 elements");
    expect_error([&] { c.all_reduce(cpu(), Tensor::zeros({2}, DType::U8), ReduceOp::Sum); },
                 "reductions support f32, f64, bf16, i32 and i64; found u8");
    expect_error([&] { c.all_gather(cpu(), Tensor::zeros({8}, DType::I32), f4); }, "must have the same dtype");
    expect_error([&] { c.broadcast(cpu(), f4, 2); }, "root must be in [0, 2); found 2");
    expect_error([&] { c.send(cpu(), f4, -1); }, "peer must be in [0, 2); found -1");
    expect_error(
        [&] {
          c.all_to_all_v(cpu(), Tensor::zeros({2, 2}, DType::F32), {1, 1}, f4.view({2, 2}), {1});
        },
        "one entry per rank (2)");
    expect_error(
        [&] {
          c.all_to_all_v(cpu(), Tensor::zeros({2, 2}, DType::F32), {1, 1}, f4.view({2, 2}), {2, 1});
        },
        "send_rows sum to 3 but in has 2 rows");
    expect_error([&] { c.group_end(); }, "group_end on 'world' (rank");
    Stream gpu_stream(Device::cuda(0), nullptr);
    expect_error([&] { c.barrier(gpu_stream); }, "runs on the CPU stream");
    c.barrier(cpu());  // nothing above reached the other rank
  });
}

TEST(LocalWorld, HandsOutEachRankOnce) {
  std::shared_ptr<LocalWorld> world = LocalWorld::create(2);
  EXPECT_EQ(world->size(), 2);
  std::unique_ptr<Communicator> c0 = world->communicator(0);
  EXPECT_EQ(c0->rank(), 0);
  EXPECT_EQ(c0->size(), 2);
  EXPECT_EQ(c0->name(), "world");
  EXPECT_TRUE(is_local_communicator(*c0));
  EXPECT_THROW(world->communicator(0), Error);
  EXPECT_THROW(world->communicator(2), Error);
  EXPECT_THROW(LocalWorld::create(0), Error);
}

TEST(LocalWorld, CheckHealthReportsAnAbort) {
  std::shared_ptr<LocalWorld> world = LocalWorld::create(2);
  std::unique_ptr<Communicator> c0 = world->communicator(0);
  c0->check_health();
  world->abort(1, "out of memory");
  try {
    c0->check_health();
    ADD_FAILURE() << "check_health should throw after an abort";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 failed (out of memory)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moetrain::dist
