// Tests of the exact lanes' kernels on CUDA (KernelPolicy::BatchInvariant, core/device.h): for each kernel exact mode
// certifies (exact::cuda_batch_invariant_kernels), the bytes of a row do not change when the number of rows, the
// row's position or its neighbours change; the dense GEMM's two kernels against the CPU reference; attention kept off
// cuDNN; and the data the policy refuses rather than summing in another order.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/attention.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/gated_delta.h"
#include "ops/cuda/gemm_batch_invariant.h"
#endif
#include "ops/gated_delta.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/loss.h"
#include "ops/norm.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::same_bytes;

// Runs the scope's ops under the exact lanes' policy and hands the stream back to the fastest kernels after.
class BatchInvariantScope {
 public:
  BatchInvariantScope() { gpu().hold_batch_invariant(); }
  ~BatchInvariantScope() { gpu().release_batch_invariant(); }
  BatchInvariantScope(const BatchInvariantScope&) = delete;
  BatchInvariantScope& operator=(const BatchInvariantScope&) = delete;
};

// Rows `rows` of a host tensor (any dtype, rows along dim 0), in that order.
Tensor gather_rows(const Tensor& host, const std::vector<int64_t>& rows) {
  Shape shape = host.shape();
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::empty(shape, host.dtype());
  const size_t row_bytes = host.nbytes() / static_cast<size_t>(host.size(0));
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(static_cast<char*>(out.raw_data()) + i * row_bytes,
                static_cast<const char*>(host.raw_data()) + static_cast<size_t>(rows[i]) * row_bytes, row_bytes);
  }
  return out;
}

// Whether row `a_row` of `a` and row `b_row` of `b` (host tensors of one dtype and row width) hold the same bytes.
bool same_row(const Tensor& a, int64_t a_row, const Tensor& b, int64_t b_row) {
  const size_t row_bytes = a.nbytes() / static_cast<size_t>(a.size(0));
  EXPECT_EQ(row_bytes, b.nbytes() / static_cast<size_t>(b.size(0)));
  return std::memcmp(static_cast<const char*>(a.raw_data()) + static_cast<size_t>(a_row) * row_bytes,
                     static_cast<const char*>(b.raw_data()) + static_cast<size_t>(b_row) * row_bytes, row_bytes) == 0;
}

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

// Batches that hold rows of a full batch of `total` rows: `rows` (the full batch's row indices, in the batch's
// order) plus fresh random rows (index -1) as neighbours.
struct Regrouping {
  std::string name;
  std::vector<int64_t> rows;
};

std::vector<Regrouping> regroupings(int64_t total) {
  std::vector<int64_t> reversed = range(0, total);
  std::reverse(reversed.begin(), reversed.end());
  return {
      {"the first row alone", {0}},
      {"a middle run", range(total / 3, total - 5)},
      {"every row in reverse order", reversed},
      {"one row among new neighbours", {-1, -1, -1, -1, -1, total / 2, -1, -1, -1, -1, -1, -1}},
      {"rows with new neighbours and a long batch",
       [&] {
         std::vector<int64_t> v;
         for (int64_t i = 0; i < 2 * total; ++i) v.push_back(i % 3 == 1 ? (i * 7) % total : -1);
         return v;
       }()},
  };
}

// The host rows of `full` named by `rows`, with index -1 drawn from `fresh` (a host tensor with the row width).
Tensor rows_with_fresh(const Tensor& full, const std::vector<int64_t>& rows, const Tensor& fresh) {
  Tensor out = gather_rows(full, std::vector<int64_t>(rows.size(), 0));
  const size_t row_bytes = full.nbytes() / static_cast<size_t>(full.size(0));
  for (size_t i = 0; i < rows.size(); ++i) {
    const Tensor& source = rows[i] < 0 ? fresh : full;
    const int64_t at = rows[i] < 0 ? static_cast<int64_t>(i) % fresh.size(0) : rows[i];
    std::memcpy(static_cast<char*>(out.raw_data()) + i * row_bytes,
                static_cast<const char*>(source.raw_data()) + static_cast<size_t>(at) * row_bytes, row_bytes);
  }
  return out;
}

struct GemmCase {
  int64_t n, k;
  Transpose transpose_b;
  DType out;
  double beta;
  bool cutlass;  // the kernel the rule picks
};

std::string gemm_name(const GemmCase& c) {
  return fmt::format("N={} K={} {} out {} beta {} ({})", c.n, c.k, c.transpose_b == Transpose::Yes ? "a b^T" : "a b",
                     dtype_name(c.out), c.beta, c.cutlass ? "CUTLASS" : "tiled");
}

// Forward (a b^T) and input-gradient (a b) products on both kernels, each output dtype, beta 0 and 1.
const std::vector<GemmCase> kGemmCases = {
    {256, 512, Transpose::Yes, DType::BF16, 0.0, true}, {136, 256, Transpose::Yes, DType::F32, 0.0, true},
    {512, 256, Transpose::No, DType::BF16, 0.0, true},  {256, 128, Transpose::No, DType::F32, 0.0, true},
    {256, 128, Transpose::No, DType::F32, 1.0, true},   {100, 60, Transpose::Yes, DType::BF16, 0.0, false},
    {33, 70, Transpose::No, DType::F32, 1.0, false},    {256, 64, Transpose::Yes, DType::F32, 1.0, false},
    {64, 96, Transpose::Yes, DType::BF16, 0.0, true},
};

// out = a op(b) (+ beta out) on the GPU under the policy, from host operands; the result on the host.
Tensor run_gemm(const GemmCase& c, const Tensor& a_bf16, const Tensor& b_bf16, const Tensor& c_init) {
  const int64_t m = a_bf16.size(0);
  Tensor out = Tensor::empty({m, c.n}, c.out, Device::cuda(0));
  if (c.beta != 0.0) out.copy_from(on_gpu(c_init.to(c.out)));
  gemm(gpu(), out, on_gpu(a_bf16), Transpose::No, on_gpu(b_bf16), c.transpose_b, 1.0, c.beta);
  return out.to(Device::cpu());
}

TEST(CudaBatchInvariance, GemmRowBytesDoNotDependOnTheBatch) {
  MT_REQUIRE_GPU();
  const BatchInvariantScope policy;
  constexpr int64_t kRows = 300;
  for (const GemmCase& c : kGemmCases) {
    SCOPED_TRACE(gemm_name(c));
#if MOETRAIN_HAS_CUDA
    EXPECT_EQ(cuda::batch_invariant_gemm_uses_cutlass(DType::BF16, c.out, c.n, c.k, c.transpose_b, 1.0, c.beta),
              c.cutlass);
#endif
    Rng rng(static_cast<uint64_t>(c.n * 1000 + c.k));
    const Tensor a = random_tensor({kRows, c.k}, DType::F32, rng).to(DType::BF16);
    const Tensor fresh = random_tensor({kRows, c.k}, DType::F32, rng).to(DType::BF16);
    const Shape b_shape = c.transpose_b == Transpose::Yes ? Shape{c.n, c.k} : Shape{c.k, c.n};
    const Tensor b = random_tensor(b_shape, DType::F32, rng, 0.1).to(DType::BF16);
    const Tensor c_init = random_tensor({kRows, c.n}, DType::F32, rng);
    const Tensor c_fresh = random_tensor({kRows, c.n}, DType::F32, rng);
    const Tensor full = run_gemm(c, a, b, c_init);

    // Against the CPU reference on the same bf16 values.
    Tensor want = c.beta != 0.0 ? c_init.to(c.out).to(DType::F32) : Tensor::zeros({kRows, c.n}, DType::F32);
    gemm(Stream::cpu(), want, a.to(DType::F32), Transpose::No, b.to(DType::F32), c.transpose_b, 1.0, c.beta);
    const double err = testing::relative_error(host_f32(full), want);
    std::printf("    %-60s relative error vs CPU %.3e\n", gemm_name(c).c_str(), err);
    EXPECT_LE(err, c.out == DType::BF16 ? 0x1p-8 : 1e-5);

    for (const Regrouping& g : regroupings(kRows)) {
      SCOPED_TRACE(g.name);
      const Tensor part = run_gemm(c, rows_with_fresh(a, g.rows, fresh), b, rows_with_fresh(c_init, g.rows, c_fresh));
      for (size_t i = 0; i < g.rows.size(); ++i) {
        if (g.rows[i] < 0) continue;
        ASSERT_TRUE(same_row(part, static_cast<int64_t>(i), full, g.rows[i])) << "row " << i;
      }
    }
  }
}

TEST(CudaBatchInvariance, GemmRefusesMisalignedDataOnCutlassShapesInsteadOfRunningAnotherKernel) {
  MT_REQUIRE_GPU();
  Rng rng(5);
  const Tensor flat = on_gpu(random_tensor({1 + 16 * 64}, DType::F32, rng).to(DType::BF16));
  const Tensor misaligned = flat.slice(1, 1 + 16 * 64).view({16, 64});  // starts 2 bytes into the buffer
  const Tensor w = on_gpu(random_tensor({128, 64}, DType::F32, rng).to(DType::BF16));
  Tensor y = Tensor::empty({16, 128}, DType::BF16, Device::cuda(0));
  linear_forward(gpu(), y, misaligned, w);  // the fastest kernels take it
  const BatchInvariantScope policy;
  testing::expect_error([&] { linear_forward(gpu(), y, misaligned, w); }, "16-byte aligned");
}

TEST(CudaBatchInvariance, WeightGradientsStayDeterministic) {
  MT_REQUIRE_GPU();
  const BatchInvariantScope policy;
  Rng rng(6);
  const Tensor dy = on_gpu(random_tensor({333, 256}, DType::F32, rng).to(DType::BF16));
  const Tensor x = on_gpu(random_tensor({333, 128}, DType::F32, rng).to(DType::BF16));
  Tensor first = Tensor::zeros({256, 128}, DType::F32, Device::cuda(0));
  Tensor second = Tensor::zeros({256, 128}, DType::F32, Device::cuda(0));
  linear_backward_weight(gpu(), first, dy, x);
  linear_backward_weight(gpu(), second, dy, x);
  EXPECT_TRUE(same_bytes(first, second));
}

// Group sizes and a row's place in its group change; its bytes do not. Both the CUTLASS shapes and the generic ones.
TEST(CudaBatchInvariance, GroupedGemmRowBytesDoNotDependOnTheirGroupOrPosition) {
  MT_REQUIRE_GPU();
  const BatchInvariantScope policy;
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{256, 128}, {20, 12}}) {
    SCOPED_TRACE(fmt::format("N={} K={}", n, k));
    Rng rng(static_cast<uint64_t>(n + k));
    const Tensor x = random_tensor({200, k}, DType::F32, rng).to(DType::BF16);
    const Tensor dy = random_tensor({200, n}, DType::F32, rng).to(DType::BF16);
    const Tensor w = on_gpu(random_tensor({4, n, k}, DType::F32, rng, 0.1).to(DType::BF16));
    const auto forward = [&](const Tensor& rows, std::vector<int32_t> offsets) {
      Tensor y = Tensor::empty({rows.size(0), n}, DType::BF16, Device::cuda(0));
      grouped_linear_forward(gpu(), y, on_gpu(rows), w, on_gpu(Tensor::from_vector(offsets, {5})));
      return y.to(Device::cpu());
    };
    const auto backward_input = [&](const Tensor& rows, std::vector<int32_t> offsets) {
      Tensor dx = Tensor::empty({rows.size(0), k}, DType::BF16, Device::cuda(0));
      grouped_linear_backward_input(gpu(), dx, on_gpu(rows), w, on_gpu(Tensor::from_vector(offsets, {5})));
      return dx.to(Device::cpu());
    };
    // Group 2 holds rows [50, 130) of the full batch; alone, rows 60..62 form a group of 3 at rows 0..2.
    const std::vector<int32_t> full_offsets = {0, 50, 50, 130, 200};
    const std::vector<int32_t> small_offsets = {0, 0, 0, 3, 3};
    const std::vector<int64_t> picked = {60, 61, 62};
    const Tensor y_full = forward(x, full_offsets), y_small = forward(gather_rows(x, picked), small_offsets);
    const Tensor dx_full = backward_input(dy, full_offsets),
                 dx_small = backward_input(gather_rows(dy, picked), small_offsets);
    for (size_t i = 0; i < picked.size(); ++i) {
      EXPECT_TRUE(same_row(y_small, static_cast<int64_t>(i), y_full, picked[i])) << "forward row " << picked[i];
      EXPECT_TRUE(same_row(dx_small, static_cast<int64_t>(i), dx_full, picked[i])) << "dx row " << picked[i];
    }
  }
}

struct AttentionRun {
  Tensor out, lse;  // on the host
};

// Our kernels' forward over documents of `lengths`, bf16, 4 query heads on 2 kv heads of 128.
AttentionRun run_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu,
                           int64_t max_seqlen) {
  const int64_t T = q.size(0);
  Tensor out = Tensor::empty({T, 4, 128}, DType::BF16, Device::cuda(0));
  Tensor lse = Tensor::empty({T, 4}, DType::F32, Device::cuda(0));
  AttentionParams params;
  params.softmax_scale = 1.0f / std::sqrt(128.0f);
  params.max_seqlen = max_seqlen;
  attention_forward(gpu(), out, lse, on_gpu(q), on_gpu(k), on_gpu(v),
                    on_gpu(Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())})), params);
  return {out.to(Device::cpu()), lse.to(Device::cpu())};
}

TEST(CudaBatchInvariance, AttentionDocumentBytesDoNotDependOnTheirOffsetOrNeighboursAndCudnnStaysOff) {
  MT_REQUIRE_GPU();
  Rng rng(8);
  // Documents of 70, 5, 130 and 40 tokens packed in one run.
  const std::vector<int32_t> cu = {0, 70, 75, 205, 245};
  const int64_t T = cu.back();
  const Tensor q = random_tensor({T, 4, 128}, DType::F32, rng).to(DType::BF16);
  const Tensor k = random_tensor({T, 2, 128}, DType::F32, rng).to(DType::BF16);
  const Tensor v = random_tensor({T, 2, 128}, DType::F32, rng).to(DType::BF16);
  const AttentionRun own = run_attention(q, k, v, cu, 0);
  const BatchInvariantScope policy;
  // With the longest document known the fastest policy would run cuDNN; the exact lanes run the same kernels as above.
  const AttentionRun packed = run_attention(q, k, v, cu, 130);
  EXPECT_TRUE(same_bytes(packed.out, own.out));
  EXPECT_TRUE(same_bytes(packed.lse, own.lse));
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    SCOPED_TRACE("document " + std::to_string(d));
    const std::vector<int64_t> rows = range(cu[d], cu[d + 1]);
    const int32_t len = cu[d + 1] - cu[d];
    const AttentionRun alone =
        run_attention(gather_rows(q, rows), gather_rows(k, rows), gather_rows(v, rows), {0, len}, len);
    for (int64_t i = 0; i < len; ++i) {
      ASSERT_TRUE(same_row(alone.out, i, packed.out, cu[d] + i)) << "token " << i;
      ASSERT_TRUE(same_row(alone.lse, i, packed.lse, cu[d] + i)) << "token " << i;
    }
  }
}

TEST(CudaBatchInvariance, NormAndCrossEntropyRowsDoNotDependOnTheBatchAndRefuseMisalignedData) {
  MT_REQUIRE_GPU();
  Rng rng(9);
  const Tensor x = random_tensor({257, 512}, DType::F32, rng).to(DType::BF16);
  const Tensor w = on_gpu(random_tensor({512}, DType::F32, rng));
  std::vector<int32_t> target_values(257);
  for (int64_t t = 0; t < 257; ++t) target_values[static_cast<size_t>(t)] = static_cast<int32_t>((t * 37) % 512);
  const Tensor targets = Tensor::from_vector(target_values, {257});
  const BatchInvariantScope policy;
  const auto norm = [&](const Tensor& rows) {
    Tensor y = Tensor::empty(rows.shape(), DType::BF16, Device::cuda(0));
    Tensor rstd = Tensor::empty({rows.size(0)}, DType::F32, Device::cuda(0));
    rmsnorm_forward(gpu(), y, rstd, on_gpu(rows), w, RmsNormParams{});
    return y.to(Device::cpu());
  };
  const auto lse_of = [&](const Tensor& rows, const Tensor& row_targets) {
    Tensor losses = Tensor::empty({rows.size(0)}, DType::F32, Device::cuda(0));
    Tensor lse = Tensor::empty({rows.size(0)}, DType::F32, Device::cuda(0));
    cross_entropy_forward(gpu(), losses, lse, on_gpu(rows), on_gpu(row_targets));
    return lse.to(Device::cpu()).view({rows.size(0), 1});
  };
  const Tensor y_full = norm(x), lse_full = lse_of(x, targets);
  const std::vector<int64_t> picked = {200, 3, 17};
  const Tensor y_small = norm(gather_rows(x, picked));
  const Tensor lse_small = lse_of(gather_rows(x, picked), gather_rows(targets.view({257, 1}), picked).view({3}));
  for (size_t i = 0; i < picked.size(); ++i) {
    EXPECT_TRUE(same_row(y_small, static_cast<int64_t>(i), y_full, picked[i]));
    EXPECT_TRUE(same_row(lse_small, static_cast<int64_t>(i), lse_full, picked[i]));
  }

  // A view that starts 2 bytes into its buffer: summed in packs of 8 only when aligned, so refused under the policy.
  const Tensor flat = on_gpu(random_tensor({1 + 4 * 512}, DType::F32, rng).to(DType::BF16));
  const Tensor misaligned = flat.slice(1, 1 + 4 * 512).view({4, 512});
  Tensor y = Tensor::empty({4, 512}, DType::BF16, Device::cuda(0));
  Tensor rstd = Tensor::empty({4}, DType::F32, Device::cuda(0));
  testing::expect_error([&] { rmsnorm_forward(gpu(), y, rstd, misaligned, w, RmsNormParams{}); }, "16-byte aligned");
  Tensor losses = Tensor::empty({4}, DType::F32, Device::cuda(0)),
         lse = Tensor::empty({4}, DType::F32, Device::cuda(0));
  testing::expect_error([&] { cross_entropy_forward(gpu(), losses, lse, misaligned, on_gpu(targets.slice(0, 4))); },
                        "16-byte aligned");
}

TEST(CudaBatchInvariance, GatedDeltaRunsTheSequentialScanWhoseDocumentsDoNotDependOnTheirNeighbours) {
  MT_REQUIRE_GPU();
  Rng rng(10);
  const std::vector<int32_t> cu = {0, 1, 65, 100, 230};
  const int64_t T = cu.back(), hk = 2, hv = 4, dk = 64, dv = 64;
  Tensor q = random_tensor({T, hk, dk}, DType::F32, rng, 0.125).to(DType::BF16);
  Tensor k = random_tensor({T, hk, dk}, DType::F32, rng, 0.125).to(DType::BF16);
  const Tensor v = random_tensor({T, hv, dv}, DType::F32, rng).to(DType::BF16);
  Tensor g = random_tensor({T, hv}, DType::F32, rng, 0.1);
  Tensor beta = random_tensor({T, hv}, DType::F32, rng);
  for (int64_t i = 0; i < g.numel(); ++i) {
    g.data<float>()[i] = -std::abs(g.data<float>()[i]);
    beta.data<float>()[i] = 1.0f / (1.0f + std::exp(-beta.data<float>()[i]));
  }
  const float scale = 0.125f;
  const BatchInvariantScope policy;
  const auto run = [&](const std::vector<int64_t>& rows, const std::vector<int32_t>& doc_cu) {
    Tensor out = Tensor::empty({static_cast<int64_t>(rows.size()), hv, dv}, DType::BF16, Device::cuda(0));
    const Tensor cu_gpu = on_gpu(Tensor::from_vector(doc_cu, {static_cast<int64_t>(doc_cu.size())}));
    gated_delta_rule_forward(gpu(), out, on_gpu(gather_rows(q, rows)), on_gpu(gather_rows(k, rows)),
                             on_gpu(gather_rows(v, rows)), on_gpu(gather_rows(g, rows)),
                             on_gpu(gather_rows(beta, rows)), cu_gpu, scale);
    return out.to(Device::cpu());
  };
  const Tensor packed = run(range(0, T), cu);
#if MOETRAIN_HAS_CUDA
  // The sequential scan itself, called directly.
  Tensor sequential = Tensor::empty({T, hv, dv}, DType::BF16, Device::cuda(0));
  cuda::gated_delta_rule_sequential_forward(gpu(), sequential, on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(g), on_gpu(beta),
                                            on_gpu(Tensor::from_vector(cu, {5})), scale);
  EXPECT_TRUE(same_bytes(packed, sequential));
#endif
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const Tensor alone = run(range(cu[d], cu[d + 1]), {0, cu[d + 1] - cu[d]});
    for (int64_t i = 0; i < cu[d + 1] - cu[d]; ++i) {
      ASSERT_TRUE(same_row(alone, i, packed, cu[d] + i)) << "document " << d << " token " << i;
    }
  }
}

}  // namespace
}  // namespace moetrain::ops
