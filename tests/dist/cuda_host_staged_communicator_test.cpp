// GPU tests for dist/host_staged_communicator: three thread ranks sharing device 0 run every op on device tensors
// (sums in rank order, rows exchanged, a grouped send / receive ring, a split), take turns on the device, and a
// failing rank stops the others with its error. Skipped without a GPU.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/host_staged_communicator.h"
#include "dist/inprocess_communicator.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"

namespace moetrain::dist {
namespace {

using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;

LocalWorldOptions on_the_gpu() {
  LocalWorldOptions options;
  options.device = Device::cuda(0);
  options.timeout = std::chrono::seconds(30);
  return options;
}

TEST(CudaHostStaged, ThreeRanksOnOneGpuRunEveryOp) {
  MT_REQUIRE_GPU();
  std::atomic<int> inside{0}, most_inside{0};
  run_local_ranks(
      3,
      [&](Communicator& world) {
        ASSERT_TRUE(is_host_staged(world));
        ASSERT_TRUE(is_local_communicator(world));
        const int r = world.rank();
        const float x = static_cast<float>(r + 1);
        // Between communicator ops a rank holds the turn: no other rank runs at the same time.
        most_inside = std::max(most_inside.load(), ++inside);
        Tensor sum = on_gpu(Tensor::from_vector<float>({x, 0.1f * x}, {2}));
        --inside;
        world.all_reduce(gpu(), sum, ReduceOp::Sum);
        ++inside;
        EXPECT_EQ(on_cpu(sum).to_vector<float>(), (std::vector<float>{6.0f, 0.1f + 0.2f + 0.3f}));
        Tensor gathered = on_gpu(Tensor::zeros({3}, DType::F32));
        --inside;
        world.all_gather(gpu(), gathered, on_gpu(Tensor::from_vector<float>({x}, {1})));
        world.barrier(gpu());
        ++inside;
        EXPECT_EQ(on_cpu(gathered).to_vector<float>(), (std::vector<float>{1.0f, 2.0f, 3.0f}));
        Tensor scattered = on_gpu(Tensor::zeros({1}, DType::F32));
        --inside;
        world.reduce_scatter(gpu(), scattered, on_gpu(Tensor::from_vector<float>({x, x, x}, {3})), ReduceOp::Max);
        ++inside;
        EXPECT_EQ(on_cpu(scattered).to_vector<float>(), (std::vector<float>{3.0f}));
        Tensor root = on_gpu(Tensor::from_vector<int64_t>({r == 2 ? 42 : 0}, {1}));
        --inside;
        world.broadcast(gpu(), root, 2);
        ++inside;
        EXPECT_EQ(on_cpu(root).to_vector<int64_t>(), (std::vector<int64_t>{42}));
        // Rank r sends one row to each rank; row value 10 r + destination.
        Tensor rows_in = on_gpu(Tensor::from_vector<int32_t>(
            {10 * r + 0, 10 * r + 0, 10 * r + 1, 10 * r + 1, 10 * r + 2, 10 * r + 2}, {3, 2}));
        Tensor rows_out = on_gpu(Tensor::zeros({3, 2}, DType::I32));
        --inside;
        world.all_to_all_v(gpu(), rows_out, {1, 1, 1}, rows_in, {1, 1, 1});
        ++inside;
        EXPECT_EQ(on_cpu(rows_out).to_vector<int32_t>(), (std::vector<int32_t>{r, r, 10 + r, 10 + r, 20 + r, 20 + r}));
        // A ring in one group: the receive lands on the device at group_end.
        Tensor received = on_gpu(Tensor::zeros({1}, DType::BF16));
        --inside;
        world.group_start();
        world.send(gpu(), on_gpu(Tensor::from_vector<float>({x}, {1}).to(DType::BF16)), (r + 1) % 3);
        world.recv(gpu(), received, (r + 2) % 3);
        world.group_end();
        ++inside;
        EXPECT_EQ(on_cpu(received).to(DType::F32).to_vector<float>(),
                  (std::vector<float>{static_cast<float>((r + 2) % 3 + 1)}));
        --inside;
        std::unique_ptr<Communicator> pair = world.split(r < 2 ? 0 : -1, r, "pair");
        ++inside;
        if (r == 2) {
          EXPECT_EQ(pair, nullptr);
          return;
        }
        ASSERT_TRUE(is_host_staged(*pair));
        Tensor pair_sum = on_gpu(Tensor::from_vector<float>({x}, {1}));
        --inside;
        pair->all_reduce(gpu(), pair_sum, ReduceOp::Sum);
        ++inside;
        EXPECT_EQ(on_cpu(pair_sum).to_vector<float>(), (std::vector<float>{3.0f}));
        --inside;
      },
      on_the_gpu());
  EXPECT_EQ(most_inside.load(), 1);
}

TEST(CudaHostStaged, AFailingRankStopsTheOthersWithItsError) {
  MT_REQUIRE_GPU();
  try {
    run_local_ranks(
        2,
        [](Communicator& world) {
          if (world.rank() == 1) throw std::runtime_error("rank 1 broke on purpose");
          Tensor t = on_gpu(Tensor::zeros({4}, DType::F32));
          world.all_reduce(gpu(), t, ReduceOp::Sum);
        },
        on_the_gpu());
    ADD_FAILURE() << "expected the failure of rank 1";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 broke on purpose"), std::string::npos) << e.what();
  }
}

TEST(CudaHostStaged, RefusesTensorsOffItsDevice) {
  MT_REQUIRE_GPU();
  testing::expect_error(
      [] {
        run_local_ranks(
            1,
            [](Communicator& world) {
              Tensor host = Tensor::zeros({2}, DType::F32);
              world.all_reduce(gpu(), host, ReduceOp::Sum);
            },
            on_the_gpu());
      },
      "cuda:0");
}

}  // namespace
}  // namespace moetrain::dist
