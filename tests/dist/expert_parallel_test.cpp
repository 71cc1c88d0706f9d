// Tests for dist/expert_parallel on thread ranks (in-process communicator): the plan's row counts and local offsets
// (a hand-computed case), dispatch delivering every row to its expert's owner in (expert, source) order, combine
// restoring the original order (round trip = identity, and a per-expert transform lands on the right rows), the
// backwards being the transposes (dot-product test), uneven and empty experts and ranks, and the refusals.
#include "dist/expert_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "dist/inprocess_communicator.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::dist {
namespace {

using testing::expect_error;

constexpr int64_t kWidth = 3;  // elements per row

// Rows per expert of rank p (seeded, so every rank can compute every rank's counts): uneven, with empty experts,
// and rank 1 sends no rows at all when `rank1_empty`.
std::vector<int64_t> counts_of(int p, int64_t E, uint64_t seed, bool rank1_empty) {
  Rng rng(seed * 131 + static_cast<uint64_t>(p));
  std::vector<int64_t> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const uint64_t roll = rng.below(4);
    c[static_cast<size_t>(e)] = roll == 0 ? 0 : static_cast<int64_t>(rng.below(7)) + (roll == 3 ? 5 : 0);
  }
  if (rank1_empty && p == 1) std::fill(c.begin(), c.end(), 0);
  return c;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> o{0};
  for (int64_t c : counts) o.push_back(o.back() + c);
  return o;
}

Tensor offsets_tensor(const std::vector<int64_t>& offsets) {
  return Tensor::from_vector(std::vector<int32_t>(offsets.begin(), offsets.end()),
                             {static_cast<int64_t>(offsets.size())});
}

// Row i of rank p holds (p * 1000 + i) * 10 + h in column h: every row says where it came from.
float row_value(int p, int64_t i, int64_t h) { return static_cast<float>((p * 1000 + i) * 10 + h); }

Tensor rows_of(int p, int64_t rows) {
  std::vector<float> v;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < kWidth; ++h) v.push_back(row_value(p, i, h));
  return Tensor::from_vector(v, {rows, kWidth});
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

TEST(ExpertParallel, PlanCountsAndLocalOffsetsByHand) {
  // ep 2, E 4: rank 0 has rows per expert {1, 2, 0, 3}, rank 1 has {0, 2, 3, 0}.
  const std::vector<int64_t> all = {0, 1, 3, 3, 6, /* rank 1 */ 0, 0, 2, 5, 5};
  const ExpertParallelPlan p0 = ExpertParallelPlan::from_offsets(2, 0, 4, all);
  EXPECT_EQ(p0.local_experts(), 2);
  EXPECT_EQ(p0.dispatched_rows(), 6);
  EXPECT_EQ(p0.send_rows(), (std::vector<int64_t>{3, 3}));  // experts 0-1 stay, 2-3 go to rank 1
  EXPECT_EQ(p0.recv_rows(), (std::vector<int64_t>{3, 2}));  // rank 1 sends its rows of experts 0-1
  EXPECT_EQ(p0.local_rows(), 5);
  EXPECT_EQ(p0.local_offsets_host(), (std::vector<int64_t>{0, 1, 5, 5, 5}));
  EXPECT_EQ(p0.local_group_offsets().to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 5, 5, 5}));

  const ExpertParallelPlan p1 = ExpertParallelPlan::from_offsets(2, 1, 4, all);
  EXPECT_EQ(p1.dispatched_rows(), 5);
  EXPECT_EQ(p1.send_rows(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(p1.recv_rows(), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(p1.local_offsets_host(), (std::vector<int64_t>{0, 0, 0, 3, 6}));
}

// Every rank dispatches its rows; each receiver checks it got, for each of its experts in order, every source's
// rows of that expert (source 0 first), and that the local group offsets say so.
TEST(ExpertParallel, DispatchDeliversRowsInExpertThenSourceOrder) {
  for (int ep : {1, 2, 4}) {
    for (bool rank1_empty : {false, true}) {
      SCOPED_TRACE("ep=" + std::to_string(ep) + (rank1_empty ? " rank 1 without rows" : ""));
      const int64_t E = 8;
      const uint64_t seed = 7 + static_cast<uint64_t>(ep);
      run_local_ranks(ep, [&](Communicator& comm) {
        const int me = comm.rank();
        std::vector<std::vector<int64_t>> counts, offsets;
        for (int p = 0; p < ep; ++p) {
          counts.push_back(counts_of(p, E, seed, rank1_empty));
          offsets.push_back(offsets_of(counts.back()));
        }
        const ExpertParallelPlan plan =
            ExpertParallelPlan::create(comm, Stream::cpu(), offsets_tensor(offsets[static_cast<size_t>(me)]), E);
        const Tensor local = plan.dispatch(comm, Stream::cpu(), rows_of(me, offsets[static_cast<size_t>(me)].back()));

        std::vector<float> want;
        std::vector<int32_t> want_offsets{0};
        const int64_t El = E / ep;
        for (int64_t e = 0; e < E; ++e) {
          int64_t rows = 0;
          if (e / El == me) {
            for (int p = 0; p < ep; ++p) {
              for (int64_t i = offsets[static_cast<size_t>(p)][static_cast<size_t>(e)];
                   i < offsets[static_cast<size_t>(p)][static_cast<size_t>(e + 1)]; ++i) {
                for (int64_t h = 0; h < kWidth; ++h) want.push_back(row_value(p, i, h));
                ++rows;
              }
            }
          }
          want_offsets.push_back(want_offsets.back() + static_cast<int32_t>(rows));
        }
        EXPECT_EQ(local.shape(), (Shape{static_cast<int64_t>(want.size()) / kWidth, kWidth})) << "rank " << me;
        EXPECT_EQ(local.to_vector<float>(), want) << "rank " << me;
        EXPECT_EQ(plan.local_group_offsets().to_vector<int32_t>(), want_offsets) << "rank " << me;
      });
    }
  }
}

// combine(f(dispatch(x))) = f(x) row by row, where f scales each row by its (global) expert index + 1, computed on
// the receiver from the local group offsets: the identity (f = 1) and the expert each row was routed to.
TEST(ExpertParallel, CombineRestoresOriginalOrder) {
  for (int ep : {1, 2, 4}) {
    for (bool rank1_empty : {false, true}) {
      SCOPED_TRACE("ep=" + std::to_string(ep) + (rank1_empty ? " rank 1 without rows" : ""));
      const int64_t E = 8;
      const uint64_t seed = 21 + static_cast<uint64_t>(ep);
      run_local_ranks(ep, [&](Communicator& comm) {
        const int me = comm.rank();
        const std::vector<int64_t> offsets = offsets_of(counts_of(me, E, seed, rank1_empty));
        const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), offsets_tensor(offsets), E);
        const Tensor x = rows_of(me, offsets.back());
        const Tensor local = plan.dispatch(comm, Stream::cpu(), x);

        const Tensor back = plan.combine(comm, Stream::cpu(), local);
        EXPECT_TRUE(bitwise_equal(back, x)) << "rank " << me << ": the round trip is not the identity";

        Tensor scaled = local.clone();
        const std::vector<int64_t>& lo = plan.local_offsets_host();
        for (int64_t e = 0; e < E; ++e)
          for (int64_t r = lo[static_cast<size_t>(e)]; r < lo[static_cast<size_t>(e + 1)]; ++r)
            for (int64_t h = 0; h < kWidth; ++h) scaled.data<float>()[r * kWidth + h] *= static_cast<float>(e + 1);
        const Tensor combined = plan.combine(comm, Stream::cpu(), scaled);
        std::vector<float> want = x.to_vector<float>();
        for (int64_t e = 0; e < E; ++e)
          for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e + 1)]; ++r)
            for (int64_t h = 0; h < kWidth; ++h) want[static_cast<size_t>(r * kWidth + h)] *= static_cast<float>(e + 1);
        EXPECT_EQ(combined.to_vector<float>(), want) << "rank " << me;
      });
    }
  }
}

// The backwards are the transposes: sum over ranks <dispatch(x), y> = sum over ranks <x, dispatch_backward(y)>, and
// the same for combine, with random f64 x and y. Both sides add the same products in different orders, hence the
// 1e-12 relative tolerance.
TEST(ExpertParallel, BackwardsAreTransposes) {
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep=" + std::to_string(ep));
    const int64_t E = 8;
    run_local_ranks(ep, [&](Communicator& comm) {
      const int me = comm.rank();
      Rng rng(99 + static_cast<uint64_t>(me));
      const std::vector<int64_t> offsets = offsets_of(counts_of(me, E, 5, false));
      const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), offsets_tensor(offsets), E);
      const Tensor x = testing::random_tensor({plan.dispatched_rows(), kWidth}, DType::F64, rng);
      const Tensor y = testing::random_tensor({plan.local_rows(), kWidth}, DType::F64, rng);
      const Tensor u = testing::random_tensor({plan.local_rows(), kWidth}, DType::F64, rng);
      const Tensor v = testing::random_tensor({plan.dispatched_rows(), kWidth}, DType::F64, rng);
      // {<dispatch(x), y>, <x, dispatch_backward(y)>, <combine(u), v>, <u, combine_backward(v)>}, summed over ranks.
      Tensor dots = Tensor::from_vector<double>({testing::dot(plan.dispatch(comm, Stream::cpu(), x), y),
                                                 testing::dot(x, plan.dispatch_backward(comm, Stream::cpu(), y)),
                                                 testing::dot(plan.combine(comm, Stream::cpu(), u), v),
                                                 testing::dot(u, plan.combine_backward(comm, Stream::cpu(), v))},
                                                {4});
      comm.all_reduce(Stream::cpu(), dots, ReduceOp::Sum);
      const std::vector<double> d = dots.to_vector<double>();
      EXPECT_NEAR(d[0], d[1], 1e-12 * std::abs(d[0])) << "dispatch";
      EXPECT_NEAR(d[2], d[3], 1e-12 * std::abs(d[2])) << "combine";
      EXPECT_NE(d[0], 0.0);
    });
  }
}

TEST(ExpertParallel, RejectsBadOffsetsAndRows) {
  expect_error([] { ExpertParallelPlan::from_offsets(3, 0, 4, std::vector<int64_t>(15, 0)); },
               "num_experts (4) must be positive and divisible by ep (3)");
  expect_error([] { ExpertParallelPlan::from_offsets(2, 0, 4, std::vector<int64_t>(9, 0)); },
               "expected ep (2) x (num_experts + 1) (5) = 10 group offsets, found 9");
  expect_error(
      [] {
        ExpertParallelPlan::from_offsets(2, 0, 2, {0, 1, 2, 0, 3, 2});
      },
      "ep rank 1's group offsets must not decrease; found offsets[1] = 3 > offsets[2] = 2");
  expect_error(
      [] {
        ExpertParallelPlan::from_offsets(2, 0, 2, {0, 1, 2, 1, 3, 4});
      },
      "ep rank 1's group offsets must start at 0; found 1");
  run_local_ranks(2, [&](Communicator& comm) {
    expect_error([&] { ExpertParallelPlan::create(comm, Stream::cpu(), Tensor::zeros({5}, DType::I64), 4); },
                 "group_offsets");
    expect_error([&] { ExpertParallelPlan::create(comm, Stream::cpu(), Tensor::zeros({4}, DType::I32), 4); },
                 "group_offsets");
    expect_error([&] { ExpertParallelPlan::create(comm, Stream::cpu(), Tensor::zeros({4}, DType::I32), 3); },
                 "num_experts (3) must be positive and divisible by the size of communicator 'world' (2)");
    // Rank-local checks after a valid plan: the row count must be the plan's.
    const ExpertParallelPlan plan = ExpertParallelPlan::create(comm, Stream::cpu(), offsets_tensor({0, 1, 2, 3, 4}), 4);
    expect_error(
        [&] {
          plan.dispatch(comm, Stream::cpu(), Tensor::zeros({3, kWidth}, DType::F32));
        },
        "dispatch: dispatched rows must have 4 rows (the plan's) along dim 0; found f32[3, 3] on cpu");
    expect_error(
        [&] {
          plan.combine(comm, Stream::cpu(), Tensor::zeros({5, kWidth}, DType::F32));
        },
        "combine: expert output rows must have 4 rows");
    expect_error(
        [&] {
          ExpertParallelPlan{}.dispatch(comm, Stream::cpu(), Tensor::zeros({0, kWidth}, DType::F32));
        },
        "a plan that was never made");
  });
  // A plan made for another rank of another group size.
  const ExpertParallelPlan other = ExpertParallelPlan::from_offsets(2, 1, 2, {0, 1, 1, 0, 0, 2});
  run_local_ranks(1, [&](Communicator& comm) {
    expect_error(
        [&] {
          other.dispatch(comm, Stream::cpu(), Tensor::zeros({1, kWidth}, DType::F32));
        },
        "but the plan was made for rank 1 of 2");
  });
}

}  // namespace
}  // namespace moetrain::dist
