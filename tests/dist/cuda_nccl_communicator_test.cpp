// GPU tests for dist/nccl_communicator: a one-rank NCCL world on device 0 runs every op (the
// multi-rank paths need several processes: see the lead's multi-GPU runs). Skipped without a GPU.
#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/nccl_communicator.h"
#include "ops/cuda/runtime.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"

namespace moetrain::dist {
namespace {

using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;

TEST(CudaNccl, SingleRankWorldRunsEveryOp) {
  MT_REQUIRE_GPU();
  std::unique_ptr<Communicator> world = connect_nccl_world(LaunchEnv{}, Device::cuda(0));
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->name(), "world");

  Tensor f = on_gpu(Tensor::from_vector<float>({1.5f, -2.0f}, {2}));
  world->all_reduce(gpu(), f, ReduceOp::Sum);
  Tensor bf = on_gpu(Tensor::from_vector<float>({3.0f}, {1}).to(DType::BF16));
  world->all_reduce(gpu(), bf, ReduceOp::Max);
  Tensor gathered = on_gpu(Tensor::zeros({2}, DType::F32));
  world->all_gather(gpu(), gathered, f);
  Tensor scattered = on_gpu(Tensor::zeros({2}, DType::F32));
  world->reduce_scatter(gpu(), scattered, f, ReduceOp::Sum);
  Tensor b = on_gpu(Tensor::from_vector<int64_t>({7, 8}, {2}));
  world->broadcast(gpu(), b, 0);
  Tensor rows_in = on_gpu(Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {3, 2}));
  Tensor rows_out = on_gpu(Tensor::zeros({3, 2}, DType::I32));
  world->all_to_all_v(gpu(), rows_out, {3}, rows_in, {3});
  Tensor self_recv = on_gpu(Tensor::zeros({2}, DType::F32));
  world->group_start();
  world->send(gpu(), f, 0);
  world->recv(gpu(), self_recv, 0);
  world->group_end();
  world->barrier(gpu());
  ops::cuda::synchronize(Device::cuda(0));
  world->check_health();

  EXPECT_EQ(on_cpu(f).to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(on_cpu(bf).to(DType::F32).to_vector<float>(), (std::vector<float>{3.0f}));
  EXPECT_EQ(on_cpu(gathered).to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(on_cpu(scattered).to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(on_cpu(b).to_vector<int64_t>(), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(on_cpu(rows_out).to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(on_cpu(self_recv).to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));

  std::unique_ptr<Communicator> sub = world->split(0, 0, "dp");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->name(), "dp");
  EXPECT_EQ(world->split(-1, 0, "none"), nullptr);
}

TEST(CudaNccl, RejectsHostTensorsAndOtherDevices) {
  MT_REQUIRE_GPU();
  std::unique_ptr<Communicator> world = connect_nccl_world(LaunchEnv{}, Device::cuda(0));
  Tensor host = Tensor::zeros({2}, DType::F32);
  testing::expect_error([&] { world->all_reduce(gpu(), host, ReduceOp::Sum); },
                        {"all_reduce on 'world' (rank 0)", "must be on cuda:0"});
  testing::expect_error([&] { world->barrier(Stream::cpu()); }, {"the stream is on cpu"});
  Tensor u8 = on_gpu(Tensor::zeros({2}, DType::U8));
  testing::expect_error([&] { world->all_reduce(gpu(), u8, ReduceOp::Sum); },
                        {"reductions support f32, f64, bf16, i32 and i64; found u8"});
}

}  // namespace
}  // namespace moetrain::dist
