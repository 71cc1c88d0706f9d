// Tests for ShardedTensor (ZeRO-3's unit) on thread ranks: the shards tile the tensor, gather gives back the full
// values, reduce_grad gives each rank its shard of the sum, an expert bank's range leaves the other experts' rows
// at zero, padding never leaks, the full bytes come and go under the same tensor handles, and misuse fails clearly.
#include "dist/sharded_parameters.h"

#include <vector>

#include <gtest/gtest.h>

#include "core/allocator.h"
#include "core/error.h"
#include "dist/inprocess_communicator.h"

namespace moetrain::dist {
namespace {

Tensor iota(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = scale * static_cast<float>(i + 1);
  return Tensor::from_vector(v, {n});
}

struct Full {
  Tensor master, grad;
};

// A [rows, 3] f32 parameter whose master holds 1, 2, 3, ... (the same on every rank).
Full make_full(int64_t rows) {
  return {iota(rows * 3, 1.0f).view({rows, 3}).clone(), Tensor::zeros({rows, 3}, DType::F32)};
}

ShardedTensorSpec spec_of(const Full& f, Communicator& comm, int64_t begin = 0, int64_t end = -1) {
  ShardedTensorSpec s;
  s.name = "w";
  s.weight = f.master;  // f32 compute: the weight is the master
  s.master = f.master;
  s.grad = f.grad;
  s.begin = begin;
  s.end = end;
  s.comm = &comm;
  return s;
}

TEST(ShardedTensor, ShardsTileTheTensorAndGatherRestoresIt) {
  // 7 rows x 3 = 21 elements over 4 ranks: S = 6, the last shard holds 3 values and 3 zeros of padding.
  std::vector<std::vector<float>> shards(4), gathered(4);
  run_local_ranks(4, [&](Communicator& comm) {
    Full f = make_full(7);
    ShardedTensor t(spec_of(f, comm));
    EXPECT_EQ(t.shard_numel(), 6);
    EXPECT_EQ(f.master.storage()->data, nullptr) << "the full bytes are freed after sharding";
    shards[size_t(comm.rank())] = t.master_shard().to_vector<float>();
    t.gather(Stream::cpu(), Stream::cpu());
    EXPECT_TRUE(t.gathered());
    gathered[size_t(comm.rank())] = f.master.view({-1}).to_vector<float>();  // the model's own handle
    t.release();
    EXPECT_EQ(f.master.storage()->data, nullptr);
  });
  const std::vector<float> expected = iota(21, 1.0f).to_vector<float>();
  EXPECT_EQ(shards[0], std::vector<float>(expected.begin(), expected.begin() + 6));
  EXPECT_EQ(shards[3], (std::vector<float>{19, 20, 21, 0, 0, 0}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(gathered[size_t(r)], expected) << "rank " << r;
}

TEST(ShardedTensor, ReduceGradGivesEachRankItsShardOfTheSum) {
  std::vector<std::vector<float>> reduced(3);
  run_local_ranks(3, [&](Communicator& comm) {
    Full f = make_full(4);  // 12 elements, S = 4
    ShardedTensor t(spec_of(f, comm));
    t.begin_grad(Stream::cpu());
    EXPECT_EQ(f.grad.view({-1}).to_vector<float>(), std::vector<float>(12, 0.0f)) << "begin_grad zeroes";
    f.grad.view({-1}).copy_from(iota(12, static_cast<float>(comm.rank() + 1)));  // rank r: (r + 1) * (i + 1)
    t.reduce_grad(Stream::cpu(), Stream::cpu(), t.grad_shard());
    EXPECT_FALSE(t.grad_live());
    EXPECT_EQ(f.grad.storage()->data, nullptr);
    reduced[size_t(comm.rank())] = t.grad_shard().to_vector<float>();
  });
  // Sum over ranks of (r + 1) * (i + 1) = 6 * (i + 1).
  for (int r = 0; r < 3; ++r) {
    std::vector<float> expected;
    for (int i = 4 * r; i < 4 * r + 4; ++i) expected.push_back(6.0f * static_cast<float>(i + 1));
    EXPECT_EQ(reduced[size_t(r)], expected) << "rank " << r;
  }
}

TEST(ShardedTensor, AnExpertRangeShardsOnlyItsRowsAndGathersZerosElsewhere) {
  // Rows 2..4 of a [6, 3] bank (elements [6, 15)) over 2 ranks: S = 5, the second shard padded by one.
  std::vector<std::vector<float>> gathered(2), reduced(2);
  run_local_ranks(2, [&](Communicator& comm) {
    Full f = make_full(6);
    ShardedTensor t(spec_of(f, comm, 6, 15));
    EXPECT_EQ(t.shard_numel(), 5);
    t.gather(Stream::cpu(), Stream::cpu());
    gathered[size_t(comm.rank())] = f.master.view({-1}).to_vector<float>();
    t.release();
    t.begin_grad(Stream::cpu());
    f.grad.view({-1}).copy_from(iota(18, 1.0f));  // outside [6, 15) too: dropped
    t.reduce_grad(Stream::cpu(), Stream::cpu(), t.grad_shard());
    reduced[size_t(comm.rank())] = t.grad_shard().to_vector<float>();
  });
  std::vector<float> expected(18, 0.0f);
  for (int i = 6; i < 15; ++i) expected[size_t(i)] = static_cast<float>(i + 1);
  EXPECT_EQ(gathered[0], expected);
  EXPECT_EQ(gathered[1], expected);
  EXPECT_EQ(reduced[0], (std::vector<float>{14, 16, 18, 20, 22}));  // 2 ranks x (i + 1), i = 6..10
  EXPECT_EQ(reduced[1], (std::vector<float>{24, 26, 28, 30, 0}));   // i = 11..14, then padding
}

TEST(ShardedTensor, MastersComeBackForCheckpointsAndGoAgain) {
  run_local_ranks(2, [&](Communicator& comm) {
    Full f = make_full(5);
    ShardedTensor t(spec_of(f, comm));
    t.master_shard().copy_from(iota(t.shard_numel(), comm.rank() == 0 ? -1.0f : -10.0f));  // an optimizer step
    t.materialize_master(Stream::cpu());
    const std::vector<float> full = f.master.view({-1}).to_vector<float>();
    EXPECT_EQ(full, (std::vector<float>{-1, -2, -3, -4, -5, -6, -7, -8, -10, -20, -30, -40, -50, -60, -70}));
    t.release_master();
    EXPECT_EQ(f.master.storage()->data, nullptr);
  });
}

TEST(ShardedTensor, UsingAReleasedTensorFailsWithAClearError) {
  run_local_ranks(2, [&](Communicator& comm) {
    Full f = make_full(2);
    ShardedTensor t(spec_of(f, comm));
    try {
      (void)f.master.to_vector<float>();
      ADD_FAILURE() << "reading a released parameter did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("storage bytes are released"), std::string::npos) << e.what();
    }
    EXPECT_THROW(t.reduce_grad(Stream::cpu(), Stream::cpu(), t.grad_shard()), Error) << "reduce_grad before begin_grad";
  });
}

TEST(ShardedTensor, RefusesBadSpecs) {
  run_local_ranks(2, [&](Communicator& comm) {
    Full f = make_full(2);
    EXPECT_THROW(ShardedTensor(spec_of(f, comm, 4, 2)), Error) << "empty range";
    EXPECT_THROW(ShardedTensor(spec_of(f, comm, 0, 7)), Error) << "range past the end";
    ShardedTensorSpec no_comm = spec_of(f, comm);
    no_comm.comm = nullptr;
    EXPECT_THROW(ShardedTensor{no_comm}, Error);
    ShardedTensorSpec view = spec_of(f, comm);
    view.grad = Tensor::zeros({4, 3}, DType::F32).slice(0, 2);  // not its whole storage
    EXPECT_THROW(ShardedTensor{view}, Error);
    float foreign[6] = {};
    ShardedTensorSpec blob = spec_of(f, comm);
    blob.grad = Tensor::from_blob(foreign, {2, 3}, DType::F32, Device::cpu(), nullptr);
    EXPECT_THROW(ShardedTensor{blob}, Error) << "foreign memory cannot be released";
  });
}

}  // namespace
}  // namespace moetrain::dist
