// Tests for the CUDA column-block moves (ops/cuda/columns.*) through the public ops, against the CPU reference: the
// copy bit for bit (f32, bf16, i32; repeated rows), the repeated sum bit for bit in f32 and bf16 (the same ascending
// order, f32 accumulation, one rounding). Run on a GPU; skipped elsewhere.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/columns.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;

TEST(CudaColumns, CopyMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(7);
  for (const DType dt : {DType::F32, DType::BF16}) {
    for (const int64_t repeat : {1, 16}) {
      const Tensor src = testing::random_tensor({300, 576}, DType::F32, rng).to(dt);
      const Tensor start = testing::random_tensor({300 * repeat, 192}, DType::F32, rng).to(dt);
      Tensor want = start.clone();
      copy_columns(Stream::cpu(), want, 128, src, 512, 64, repeat);
      Tensor got = on_gpu(start);
      copy_columns(gpu(), got, 128, on_gpu(src), 512, 64, repeat);
      EXPECT_TRUE(testing::same_bytes(on_cpu(got), want)) << dtype_name(dt) << " repeat " << repeat;
    }
  }
}

TEST(CudaColumns, RepeatedSumMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(9);
  for (const DType dt : {DType::F32, DType::BF16}) {
    const Tensor src = testing::random_tensor({300 * 16, 192}, DType::F32, rng).to(dt);
    Tensor want = Tensor::zeros({300, 64}, dt);
    sum_repeated_columns(Stream::cpu(), want, 0, src, 0, 64, 16);
    Tensor got = on_gpu(Tensor::zeros({300, 64}, dt));
    sum_repeated_columns(gpu(), got, 0, on_gpu(src), 0, 64, 16);
    EXPECT_TRUE(testing::same_bytes(on_cpu(got), want)) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace moetrain::ops
