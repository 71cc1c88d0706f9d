// Tests for the CUDA column-block moves (ops/cuda/columns.*) through the public ops, against the CPU reference: the
// copy bit for bit (f32, bf16, i32; repeated rows; blocks of whole 16-byte chunks and not), the repeated sum bit for
// bit in f32 and bf16 (the same ascending order, f32 accumulation, one rounding). Run on a GPU; skipped elsewhere.
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
  // Blocks of whole 16-byte chunks (latent attention's: 64 columns at 128 from 512 of 576), and blocks that are not
  // (7 columns at 3 from 5; rows of 193), which move element by element.
  struct Block {
    int64_t dst_cols, dst_col, src_cols, src_col, width;
  };
  Rng rng(7);
  for (const Block& b : {Block{192, 128, 576, 512, 64}, Block{193, 3, 576, 5, 7}, Block{192, 8, 200, 0, 184}}) {
    for (const DType dt : {DType::F32, DType::BF16, DType::I32}) {
      for (const int64_t repeat : {1, 16}) {
        const Tensor src = testing::random_tensor({300, b.src_cols}, DType::F32, rng, 1000.0).to(dt);
        const Tensor start = testing::random_tensor({300 * repeat, b.dst_cols}, DType::F32, rng, 1000.0).to(dt);
        Tensor want = start.clone();
        copy_columns(Stream::cpu(), want, b.dst_col, src, b.src_col, b.width, repeat);
        Tensor got = on_gpu(start);
        copy_columns(gpu(), got, b.dst_col, on_gpu(src), b.src_col, b.width, repeat);
        EXPECT_TRUE(testing::same_bytes(on_cpu(got), want))
            << dtype_name(dt) << " repeat " << repeat << " width " << b.width << " at " << b.dst_col;
      }
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
