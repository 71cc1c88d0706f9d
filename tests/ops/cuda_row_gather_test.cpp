// Tests for the CUDA row gather and segmented row sums (ops/cuda/row_gather.*) through the public ops, against the
// CPU reference: gather bit for bit in every word width (rows of 1 to 16+ bytes, f32 / bf16 / i32), sum_rows bit for
// bit in f32 and bf16 (the same ascending order from the first row, f32 accumulation, one rounding), empty and long
// segments, no rows, determinism, the guard for bad device indices and the argument checks; concat_group_rows and
// concat_group_offsets bit for bit against the CPU in every word width, and their guard for bad device offsets. Run
// on a GPU; skipped elsewhere.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/rng.h"
#include "ops/row_gather.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::host_f32;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;

Tensor vec(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

// Fails with the first differing element (and the relative error) when two tensors differ in any byte.
void expect_same_bytes(const Tensor& got_any, const Tensor& want, const std::string& what) {
  const Tensor got = on_cpu(got_any);
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const size_t size = dtype_size(got.dtype());
  const auto* pa = static_cast<const unsigned char*>(got.raw_data());
  const auto* pb = static_cast<const unsigned char*>(want.raw_data());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(pa + i * size, pb + i * size, size) != 0) {
      const bool floating = dtype_is_floating(got.dtype());
      ADD_FAILURE() << what << ": first byte difference at element " << i << " (row " << i / got.size(1) << ")"
                    << (floating ? ": got " + std::to_string(got.to(DType::F64).to_vector<double>()[i]) + ", want " +
                                       std::to_string(want.to(DType::F64).to_vector<double>()[i]) +
                                       "; relative error over the tensor " +
                                       std::to_string(testing::relative_error(host_f32(got), host_f32(want)))
                                 : std::string());
      return;
    }
  }
}

TEST(CudaRowGather, GatherMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(11);
  struct Case {
    int64_t in_rows, out_rows, hidden;
  };
  // Row bytes 2 .. 14336: every word width of the kernel (1-byte rows do not occur for these dtypes).
  for (const Case c : {Case{5, 9, 1}, Case{7, 13, 3}, Case{33, 64, 4}, Case{64, 200, 64}, Case{300, 1000, 7168},
                       Case{1, 50, 5}, Case{10, 0, 8}}) {
    for (DType dtype : {DType::F32, DType::BF16, DType::I32}) {
      const std::string what = std::string(dtype_name(dtype)) + " [" + std::to_string(c.in_rows) + ", " +
                               std::to_string(c.hidden) + "] -> " + std::to_string(c.out_rows) + " rows";
      SCOPED_TRACE(what);
      const Tensor in = random_tensor({c.in_rows, c.hidden}, DType::F64, rng, 50.0).to(dtype);
      std::vector<int32_t> index(static_cast<size_t>(c.out_rows));
      for (auto& i : index) i = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.in_rows)));
      Tensor want = Tensor::empty({c.out_rows, c.hidden}, dtype);
      gather_rows(Stream::cpu(), want, in, vec(index));
      Tensor got = Tensor::empty({c.out_rows, c.hidden}, dtype, Device::cuda(0));
      gather_rows(gpu(), got, on_gpu(in), on_gpu(vec(index)));
      expect_same_bytes(got, want, what);
    }
  }
}

// Random segments: lengths 0 .. max_len (so empty and one-row ones occur), rows repeating.
struct Segments {
  std::vector<int32_t> offsets{0}, rows;
};
Segments random_segments(int64_t segments, int64_t rows, int64_t max_len, Rng& rng) {
  Segments s;
  for (int64_t u = 0; u < segments; ++u) {
    const int64_t len = rows == 0 ? 0 : static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_len) + 1));
    for (int64_t j = 0; j < len; ++j) s.rows.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(rows))));
    s.offsets.push_back(static_cast<int32_t>(s.rows.size()));
  }
  return s;
}

// f32: the kernel adds in the CPU's order in f32, so the result is the CPU's bit for bit. bf16: both sum the bf16
// values in f32 in that order and round once to nearest even, so bf16 is bitwise as well.
TEST(CudaRowGather, SumRowsMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(12);
  struct Case {
    int64_t in_rows, segments, hidden, max_len;
  };
  for (const Case c : {Case{10, 7, 1, 3}, Case{50, 40, 5, 4}, Case{128, 100, 2048, 8}, Case{300, 20, 257, 64},
                       Case{0, 6, 16, 0}, Case{9, 0, 16, 2}}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      const std::string what = std::string(dtype_name(dtype)) + " in [" + std::to_string(c.in_rows) + ", " +
                               std::to_string(c.hidden) + "], " + std::to_string(c.segments) +
                               " segments of <= " + std::to_string(c.max_len) + " rows";
      SCOPED_TRACE(what);
      const Segments s = random_segments(c.segments, c.in_rows, c.max_len, rng);
      const Tensor in = random_tensor({c.in_rows, c.hidden}, DType::F32, rng).to(dtype);
      Tensor want = Tensor::empty({c.segments, c.hidden}, dtype);
      sum_rows(Stream::cpu(), want, in, vec(s.offsets), vec(s.rows));
      Tensor got = Tensor::empty({c.segments, c.hidden}, dtype, Device::cuda(0));
      sum_rows(gpu(), got, on_gpu(in), on_gpu(vec(s.offsets)), on_gpu(vec(s.rows)));
      if (c.segments > 0 && c.in_rows > 0) {
        const double err = testing::relative_error(host_f32(got), host_f32(want));
        EXPECT_EQ(err, 0.0) << "relative error ||gpu - cpu|| / ||cpu|| (same summation order: expected 0)";
      }
      expect_same_bytes(got, want, what);
    }
  }
}

TEST(CudaRowGather, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  Rng rng(13);
  const Segments s = random_segments(500, 400, 16, rng);
  const Tensor in = on_gpu(random_tensor({400, 1024}, DType::F32, rng).to(DType::BF16));
  const Tensor offsets = on_gpu(vec(s.offsets)), rows = on_gpu(vec(s.rows));
  Tensor a = Tensor::empty({500, 1024}, DType::BF16, Device::cuda(0));
  Tensor b = Tensor::empty({500, 1024}, DType::BF16, Device::cuda(0));
  sum_rows(gpu(), a, in, offsets, rows);
  sum_rows(gpu(), b, in, offsets, rows);
  EXPECT_TRUE(testing::same_bytes(a, b)) << "sum_rows gave different bytes on two identical runs";
  Tensor ga = Tensor::empty({static_cast<int64_t>(s.rows.size()), 1024}, DType::BF16, Device::cuda(0));
  Tensor gb = Tensor::empty(ga.shape(), DType::BF16, Device::cuda(0));
  gather_rows(gpu(), ga, in, rows);
  gather_rows(gpu(), gb, in, rows);
  EXPECT_TRUE(testing::same_bytes(ga, gb)) << "gather_rows gave different bytes on two identical runs";
}

// Device index values are not validated by the op (that would read device memory on the host); a bad one must not
// touch memory outside the tensors: gather writes 0xff bytes (a NaN) for it, sum_rows NaN for its segment. The other
// rows are still right.
TEST(CudaRowGather, BadDeviceIndicesArePoisonedNotRead) {
  MT_REQUIRE_GPU();
  const Tensor in = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor g = Tensor::empty({3, 2}, DType::F32, Device::cuda(0));
  gather_rows(gpu(), g, on_gpu(in), on_gpu(vec({2, 1000000, -1})));
  const std::vector<float> gv = on_cpu(g).to_vector<float>();
  EXPECT_EQ(gv[0], 5.0f);
  EXPECT_EQ(gv[1], 6.0f);
  for (int i = 2; i < 6; ++i) EXPECT_TRUE(std::isnan(gv[static_cast<size_t>(i)])) << "element " << i;

  Tensor s = Tensor::empty({3, 2}, DType::F32, Device::cuda(0));
  // segment 0: rows {0, 2} (fine), segment 1: row 7 (outside), segment 2: bounds past the end of segment_rows.
  sum_rows(gpu(), s, on_gpu(in), on_gpu(vec({0, 2, 3, 9})), on_gpu(vec({0, 2, 7})));
  const std::vector<float> sv = on_cpu(s).to_vector<float>();
  EXPECT_EQ(sv[0], 6.0f);
  EXPECT_EQ(sv[1], 8.0f);
  for (int i = 2; i < 6; ++i) EXPECT_TRUE(std::isnan(sv[static_cast<size_t>(i)])) << "element " << i;
}

TEST(CudaRowGather, RejectsBadArguments) {
  MT_REQUIRE_GPU();
  const Tensor in = on_gpu(Tensor::zeros({4, 3}, DType::F32));
  Tensor out = Tensor::empty({2, 3}, DType::F32, Device::cuda(0));
  expect_error([&] { gather_rows(gpu(), out, in, vec({0, 1})); }, "gather_rows: expected index on cuda:0");
  expect_error([&] { gather_rows(Stream::cpu(), out, in, on_gpu(vec({0, 1}))); }, "gather_rows: in is on cuda:0");
  expect_error(
      [&] {
        sum_rows(gpu(), on_gpu(Tensor::zeros({1, 3}, DType::F64)), on_gpu(Tensor::zeros({4, 3}, DType::F64)),
                 on_gpu(vec({0, 1})), on_gpu(vec({0})));
      },
      "sum_rows: expected in in f32 or bf16 (CUDA)");
  expect_error([&] { sum_rows(gpu(), out, in, on_gpu(vec({0, 1})), on_gpu(vec({0}))); }, "sum_rows: out");
}

TEST(CudaRowGather, ConcatGroupRowsMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(11);
  // Row widths of 2 to 5,632 bytes (every word width), 1 to 9 parts (an empty part among them), 1 to 64 groups.
  for (const auto& [width, dtype, n_parts, groups] :
       std::vector<std::tuple<int64_t, DType, int, int64_t>>{{1, DType::BF16, 3, 4},
                                                             {3, DType::BF16, 2, 1},
                                                             {5, DType::F32, 4, 7},
                                                             {4, DType::BF16, 9, 64},
                                                             {2816, DType::BF16, 4, 64},
                                                             {768, DType::F32, 2, 16}}) {
    SCOPED_TRACE(std::to_string(width) + " " + std::string(dtype_name(dtype)) + " x " + std::to_string(n_parts));
    std::vector<Tensor> parts, offsets, gpu_parts, gpu_offsets;
    int64_t total = 0;
    for (int p = 0; p < n_parts; ++p) {
      const int64_t rows = p == 1 ? 0 : static_cast<int64_t>(rng.below(300));
      total += rows;
      parts.push_back(random_tensor({rows, width}, DType::F32, rng).to(dtype));
      offsets.push_back(vec(testing::random_group_offsets(groups, rows, rng)));
      gpu_parts.push_back(on_gpu(parts.back()));
      gpu_offsets.push_back(on_gpu(offsets.back()));
    }
    Tensor want = Tensor::empty({total, width}, dtype);
    Tensor want_offsets = Tensor::empty({groups + 1}, DType::I32);
    concat_group_rows(Stream::cpu(), want, parts, offsets);
    concat_group_offsets(Stream::cpu(), want_offsets, offsets);
    Tensor got = Tensor::empty({total, width}, dtype, Device::cuda(0));
    Tensor got_offsets = Tensor::empty({groups + 1}, DType::I32, Device::cuda(0));
    concat_group_rows(gpu(), got, gpu_parts, gpu_offsets);
    concat_group_offsets(gpu(), got_offsets, gpu_offsets);
    expect_same_bytes(got, want, "rows");
    EXPECT_EQ(on_cpu(got_offsets).to_vector<int32_t>(), want_offsets.to_vector<int32_t>());
  }
}

TEST(CudaRowGather, ConcatGroupRowsNeverWritesOutsideForBadDeviceOffsets) {
  MT_REQUIRE_GPU();
  const Tensor a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  // Part 1 has one row but its offsets claim 9 in group 0: a's rows of group 1 would go to rows 10 and 11 of a
  // 4-row out. They are not written; part 1's row (group 0 by its offsets) goes after a's row of group 0.
  Tensor out = on_gpu(Tensor::from_vector<float>(std::vector<float>(8, -7.0f), {4, 2}));
  concat_group_rows(gpu(), out, {on_gpu(a), on_gpu(Tensor::zeros({1, 2}, DType::F32))},
                    {on_gpu(vec({0, 1, 3})), on_gpu(vec({0, 9, 9}))});
  EXPECT_EQ(on_cpu(out).to_vector<float>(), (std::vector<float>{1, 2, 0, 0, -7, -7, -7, -7}));
}

TEST(CudaRowGather, CountTokensPerRankMatchesTheCpu) {
  MT_REQUIRE_GPU();
  Rng rng(2026);
  for (const auto& [tokens, k, ranks, per_rank] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{1000, 8, 2, 64}, {777, 4, 8, 16}, {5, 2, 1, 4}}) {
    std::vector<int32_t> topk(static_cast<size_t>(tokens * k));
    for (auto& e : topk) e = static_cast<int32_t>(rng.below(static_cast<uint64_t>(ranks * per_rank)));
    const Tensor host = Tensor::from_vector(topk, {tokens, k});
    Tensor want = Tensor::empty({ranks}, DType::I32);
    count_tokens_per_rank(Stream::cpu(), want, host, per_rank);
    Tensor got = Tensor::empty({ranks}, DType::I32, Device::cuda());
    count_tokens_per_rank(default_stream(Device::cuda()), got, host.to(Device::cuda()), per_rank);
    EXPECT_EQ(got.to_vector<int32_t>(), want.to_vector<int32_t>()) << tokens << " tokens, " << ranks << " ranks";
  }
}

}  // namespace
}  // namespace moetrain::ops
