// Tests for the CUDA bias kernels (ops/cuda/bias.*) through the public ops: the adds bit for bit the CPU's on the
// same (rounded) values in f32 and bf16 with an f32 or bf16 bias, plain and grouped (groups empty first, in the middle
// and last); the gradients within the two-level summation's error bound of an f64 reference, bit for bit the CPU's f32
// sums when a group fits in one chunk,
// empty groups and no rows leaving the gradient's bits alone, repeated runs identical, the workload's shape, and the
// CUDA argument checks. Run on a GPU; skipped elsewhere.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/bias.h"
#include "ops/cuda/bias.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;
using testing::same_bytes;

Tensor offsets_of(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// Offsets for G groups over R rows with the given sizes.
std::vector<int32_t> offsets_from_sizes(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> offsets{0};
  for (const int32_t s : sizes) offsets.push_back(offsets.back() + s);
  return offsets;
}

// y = y + bias is one f32 add rounded to y's dtype on both backends: the GPU's bytes are the CPU's on the f32 values
// of the (rounded) inputs, rounded the same way.
void expect_add_is_the_cpu_bits(DType dtype, DType bias_dtype, const std::vector<int32_t>& sizes, int64_t width) {
  const std::vector<int32_t> offsets = offsets_from_sizes(sizes);
  const int64_t rows = offsets.back(), groups = static_cast<int64_t>(sizes.size());
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " y, " + std::string(dtype_name(bias_dtype)) +
               " bias, R=" + std::to_string(rows) + " N=" + std::to_string(width) + " G=" + std::to_string(groups));
  Rng rng(70);
  const Tensor y0 = random_tensor({rows, width}, DType::F32, rng).to(dtype);
  const Tensor bias = random_tensor({width}, DType::F32, rng).to(bias_dtype);
  const Tensor grouped = random_tensor({groups, width}, DType::F32, rng).to(bias_dtype);

  Tensor y_gpu = on_gpu(y0);
  ops::bias_add(gpu(), y_gpu, on_gpu(bias));
  Tensor y_cpu = y0.to(DType::F32);
  ops::bias_add(Stream::cpu(), y_cpu, bias.to(DType::F32));
  EXPECT_TRUE(same_bytes(y_gpu, y_cpu.to(dtype))) << "bias_add";

  Tensor yg_gpu = on_gpu(y0);
  ops::grouped_bias_add(gpu(), yg_gpu, on_gpu(grouped), on_gpu(offsets_of(offsets)));
  Tensor yg_cpu = y0.to(DType::F32);
  ops::grouped_bias_add(Stream::cpu(), yg_cpu, grouped.to(DType::F32), offsets_of(offsets));
  EXPECT_TRUE(same_bytes(yg_gpu, yg_cpu.to(dtype))) << "grouped_bias_add";
}

TEST(CudaBias, AddsAreTheCpuBits) {
  MT_REQUIRE_GPU();
  const std::vector<std::vector<int32_t>> group_sizes = {
      {5}, {0, 3, 0, 0, 7, 1, 0}, {0, 300, 0, 129, 128, 0}, {1000, 0, 1},
      {},  {40000, 0, 30001}};  // more rows than the 65535 blocks of a grid's second dimension
  for (const auto& sizes : group_sizes) {
    for (const int64_t width : {int64_t(1), int64_t(77), int64_t(640)}) {
      expect_add_is_the_cpu_bits(DType::F32, DType::F32, sizes, width);
      expect_add_is_the_cpu_bits(DType::BF16, DType::F32, sizes, width);
      expect_add_is_the_cpu_bits(DType::BF16, DType::BF16, sizes, width);
    }
  }
}

// dbias0 + per-group column sums in f64 over the (rounded) dy values; empty groups keep dbias0.
Tensor reference_sums(const Tensor& dbias0, const Tensor& dy, const std::vector<int32_t>& offsets) {
  Tensor out = dbias0.to(DType::F64);
  ops::grouped_bias_backward(Stream::cpu(), out, host_f32(dy).to(DType::F64), offsets_of(offsets));
  return out;
}

Tensor absolute(const Tensor& t) {
  std::vector<double> v = host_f32(t).to(DType::F64).to_vector<double>();
  for (double& x : v) x = std::abs(x);
  return Tensor::from_vector(v, t.shape());
}

// The GPU adds a group's rows in chunks of C = kBiasRowsPerChunk (ascending, from 0), then the chunk sums (ascending),
// then that total to dbias: every term passes through at most C + ceil(rows / C) + 1 f32 additions, each rounding by
// at most 2^-24 relative, so |gpu - exact| <= (C + ceil(rows / C) + 1) 2^-24 (|dbias0| + sum |dy|) + O(2^-48) (the
// classical bound for recursive summation applied to the two levels). Checked per element against the f64 sums.
void expect_within_the_summation_bound(const Tensor& got, const Tensor& dbias0, const Tensor& dy,
                                       const std::vector<int32_t>& offsets, const char* what) {
  const Tensor want = reference_sums(dbias0, dy, offsets);
  const Tensor magnitude = reference_sums(absolute(dbias0), absolute(dy), offsets);
  const std::vector<double> g = host_f32(got).to(DType::F64).to_vector<double>(), w = want.to_vector<double>(),
                            m = magnitude.to_vector<double>();
  const int64_t width = want.size(1);
  for (size_t gi = 0; gi + 1 < offsets.size(); ++gi) {
    const int64_t rows = offsets[gi + 1] - offsets[gi];
    const int64_t chunks = (rows + ops::cuda::kBiasRowsPerChunk - 1) / ops::cuda::kBiasRowsPerChunk;
    const double factor = static_cast<double>(ops::cuda::kBiasRowsPerChunk + chunks + 1) * std::ldexp(1.0, -24);
    int failures = 0;
    for (int64_t n = 0; n < width && failures < 5; ++n) {
      const size_t i = gi * static_cast<size_t>(width) + static_cast<size_t>(n);
      const double bound = factor * m[i] * (1.0 + 1e-6);  // the f64 reference's own rounding, far below
      if (std::abs(g[i] - w[i]) > bound) {
        ++failures;
        ADD_FAILURE() << what << ": group " << gi << " (" << rows << " rows) column " << n << ": " << g[i] << " vs "
                      << w[i] << ", bound " << bound;
      }
    }
  }
}

void expect_backward_matches(DType dtype, const std::vector<int32_t>& sizes, int64_t width) {
  const std::vector<int32_t> offsets = offsets_from_sizes(sizes);
  const int64_t rows = offsets.back(), groups = static_cast<int64_t>(sizes.size());
  const std::string what = std::string(dtype_name(dtype)) + " R=" + std::to_string(rows) +
                           " N=" + std::to_string(width) + " G=" + std::to_string(groups);
  SCOPED_TRACE(what);
  Rng rng(71);
  const Tensor dy = random_tensor({rows, width}, DType::F32, rng).to(dtype);

  // Plain: one group of all rows.
  const Tensor dbias0 = random_tensor({width}, DType::F32, rng);
  Tensor dbias = on_gpu(dbias0);
  ops::bias_backward(gpu(), dbias, on_gpu(dy));
  const std::vector<int32_t> all{0, static_cast<int32_t>(rows)};
  expect_within_the_summation_bound(dbias.view({1, width}), dbias0.view({1, width}), dy, all, "bias_backward");
  const double e_plain =
      relative_error(host_f32(dbias).to(DType::F64), reference_sums(dbias0.view({1, width}), dy, all).view({width}));

  // Grouped, from a random starting gradient.
  const Tensor grouped0 = random_tensor({groups, width}, DType::F32, rng);
  Tensor grouped = on_gpu(grouped0);
  ops::grouped_bias_backward(gpu(), grouped, on_gpu(dy), on_gpu(offsets_of(offsets)));
  expect_within_the_summation_bound(grouped, grouped0, dy, offsets, "grouped_bias_backward");
  const Tensor host = host_f32(grouped);
  const double e_grouped = relative_error(host.to(DType::F64), reference_sums(grouped0, dy, offsets));

  // A group of at most one chunk is summed exactly as the CPU does (0 + the rows in order, then added to dbias); an
  // empty group keeps its bytes.
  Tensor cpu = grouped0.clone();
  ops::grouped_bias_backward(Stream::cpu(), cpu, host_f32(dy), offsets_of(offsets));
  const std::vector<float> g = host.to_vector<float>(), c = cpu.to_vector<float>(), g0 = grouped0.to_vector<float>();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int32_t size = sizes[static_cast<size_t>(gi)];
    if (size > ops::cuda::kBiasRowsPerChunk) continue;
    for (int64_t n = 0; n < width; ++n) {
      const size_t i = static_cast<size_t>(gi * width + n);
      EXPECT_EQ(g[i], c[i]) << "group " << gi << " of " << size << " rows, column " << n;
      if (size == 0) {
        EXPECT_EQ(g[i], g0[i]) << "empty group " << gi << " column " << n;
      }
    }
  }
  std::printf("bias backward %s: rel err plain %.2e grouped %.2e\n", what.c_str(), e_plain, e_grouped);
}

TEST(CudaBias, BackwardMatchesTheF64SumsAndTheCpuBitsWithinAChunk) {
  MT_REQUIRE_GPU();
  // Groups empty first, in the middle and last; of one row, of a chunk exactly, of a chunk and one row, of many
  // chunks; more groups than chunks.
  const std::vector<std::vector<int32_t>> group_sizes = {
      {1},
      {128},
      {129},
      {0, 5, 0, 0, 128, 129, 0},
      {0, 1000, 0, 300, 0},
      {3, 0, 4, 0, 2, 0, 1, 1, 0, 6, 7, 0, 2, 9, 0, 5, 4, 3, 0, 0},
      {5000, 0, 20000, 7},
  };
  for (const DType dtype : {DType::F32, DType::BF16}) {
    for (const auto& sizes : group_sizes) {
      for (const int64_t width : {int64_t(1), int64_t(300)}) expect_backward_matches(dtype, sizes, width);
    }
  }
}

// GPT-OSS's gate_up width (2 x 2880) over a routed batch of 32 experts, one of them empty.
TEST(CudaBias, BackwardAtTheWorkloadWidth) {
  MT_REQUIRE_GPU();
  std::vector<int32_t> sizes(32, 256);
  sizes[7] = 0;
  sizes[8] = 512;
  expect_backward_matches(DType::BF16, sizes, 5760);
}

TEST(CudaBias, NoRowsLeaveTheGradientBitwiseUnchanged) {
  MT_REQUIRE_GPU();
  const Tensor dbias0 = Tensor::from_vector<float>({-0.0f, 1.5f, -2.0f}, {3});
  Tensor dbias = on_gpu(dbias0);
  ops::bias_backward(gpu(), dbias, Tensor::zeros({0, 3}, DType::BF16, Device::cuda(0)));
  EXPECT_TRUE(same_bytes(dbias, dbias0));
  const Tensor grouped0 = Tensor::from_vector<float>({-0.0f, 1.0f, -0.0f, 2.0f, 3.0f, -0.0f}, {2, 3});
  Tensor grouped = on_gpu(grouped0);
  ops::grouped_bias_backward(gpu(), grouped, Tensor::zeros({0, 3}, DType::F32, Device::cuda(0)),
                             on_gpu(offsets_of({0, 0, 0})));
  EXPECT_TRUE(same_bytes(grouped, grouped0));
  Tensor y = Tensor::zeros({0, 3}, DType::BF16, Device::cuda(0));
  ops::bias_add(gpu(), y, on_gpu(dbias0));
  ops::grouped_bias_add(gpu(), y, on_gpu(grouped0), on_gpu(offsets_of({0, 0, 0})));
}

TEST(CudaBias, RepeatedRunsGiveIdenticalBits) {
  MT_REQUIRE_GPU();
  Rng rng(72);
  const std::vector<int32_t> offsets = offsets_from_sizes({0, 3000, 17, 0, 5000});
  const Tensor dy = on_gpu(random_tensor({offsets.back(), 1000}, DType::F32, rng).to(DType::BF16));
  const Tensor off = on_gpu(offsets_of(offsets));
  Tensor first = Tensor::zeros({5, 1000}, DType::F32, Device::cuda(0));
  Tensor second = Tensor::zeros({5, 1000}, DType::F32, Device::cuda(0));
  ops::grouped_bias_backward(gpu(), first, dy, off);
  ops::grouped_bias_backward(gpu(), second, dy, off);
  EXPECT_TRUE(same_bytes(first, second));
  Tensor plain_a = Tensor::zeros({1000}, DType::F32, Device::cuda(0));
  Tensor plain_b = Tensor::zeros({1000}, DType::F32, Device::cuda(0));
  ops::bias_backward(gpu(), plain_a, dy);
  ops::bias_backward(gpu(), plain_b, dy);
  EXPECT_TRUE(same_bytes(plain_a, plain_b));
}

TEST(CudaBias, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor y64 = Tensor::zeros({4, 3}, DType::F64, cuda);
  expect_error([&] { ops::bias_add(gpu(), y64, Tensor::zeros({3}, DType::F32, cuda)); },
               {"bias_add", "y in f32 or bf16 on CUDA", "f64"});
  Tensor y16 = Tensor::zeros({4, 3}, DType::BF16, cuda);
  expect_error([&] { ops::bias_add(gpu(), y16, Tensor::zeros({3}, DType::F32)); },
               {"bias_add", "bias [N]", "stream's device cuda:0"});
  expect_error([&] { ops::bias_add(Stream::cpu(), y16, Tensor::zeros({3}, DType::F32, cuda)); },
               {"bias_add", "y is on cuda:0 but the stream runs on cpu"});
  Tensor dbias16 = Tensor::zeros({3}, DType::BF16, cuda);
  expect_error(
      [&] {
        ops::bias_backward(gpu(), dbias16, Tensor::zeros({4, 3}, DType::BF16, cuda));
      },
      {"bias_backward", "dbias [N]", "expected dtype f32 but found bf16"});
  Tensor dbias = Tensor::zeros({2, 3}, DType::F32, cuda);
  expect_error(
      [&] {
        ops::grouped_bias_backward(gpu(), dbias, Tensor::zeros({4, 3}, DType::BF16, cuda), offsets_of({0, 2, 4}));
      },
      {"grouped_bias_backward", "offsets", "stream's device cuda:0"});
  expect_error(
      [&] {
        ops::grouped_bias_add(gpu(), y16, Tensor::zeros({2, 3}, DType::F32, cuda),
                              on_gpu(Tensor::zeros({2}, DType::I32)));
      },
      {"grouped_bias_add", "offsets", "expected shape [3] but found [2]"});
}

// The biased linear under bf16 rounds once: its bytes are those of the f32 product plus bias on the GPU, cast to
// bf16 (a bias added to the bf16 product would round twice), and within bf16 rounding of the CPU's f32 result on the
// same rounded operands. Without a bias it is the plain linear.
TEST(CudaBiasedLinear, Bf16RoundsTheProductPlusBiasOnce) {
  MT_REQUIRE_GPU();
  Rng rng(81);
  const Tensor x = random_tensor({37, 96}, DType::F32, rng).to(DType::BF16);
  const Tensor w = random_tensor({80, 96}, DType::F32, rng).to(DType::BF16);
  const Tensor bias = random_tensor({80}, DType::F32, rng);
  Tensor y = Tensor::empty({37, 80}, DType::BF16, Device::cuda(0));
  ops::biased_linear_forward(gpu(), y, on_gpu(x), on_gpu(w), on_gpu(bias));
  Tensor wide = Tensor::empty({37, 80}, DType::F32, Device::cuda(0));
  ops::biased_linear_forward(gpu(), wide, on_gpu(x), on_gpu(w), on_gpu(bias));
  Tensor once = Tensor::empty({37, 80}, DType::BF16, Device::cuda(0));
  ops::cast(gpu(), once, wide);
  EXPECT_TRUE(same_bytes(y, once));
  Tensor cpu = Tensor::empty({37, 80}, DType::F32);
  ops::biased_linear_forward(Stream::cpu(), cpu, x.to(DType::F32), w.to(DType::F32), bias);
  EXPECT_LT(relative_error(host_f32(y), cpu), 4e-3);  // 2^-8 per element at most, with f32 sums of 96 terms
  Tensor plain = Tensor::empty({37, 80}, DType::BF16, Device::cuda(0));
  ops::linear_forward(gpu(), plain, on_gpu(x), on_gpu(w));
  Tensor unbiased = Tensor::empty({37, 80}, DType::BF16, Device::cuda(0));
  ops::biased_linear_forward(gpu(), unbiased, on_gpu(x), on_gpu(w), Tensor());
  EXPECT_TRUE(same_bytes(unbiased, plain));
}

}  // namespace
}  // namespace moetrain
