// Tests for the CUDA grouped expert GEMMs (ops/cuda/grouped_gemm.*) against the CPU reference (the same public ops
// on CPU tensors): forward, backward input and backward weight in f32 and bf16 over empty groups, a group holding
// all rows, skewed groups straddling 64-row tiles, more groups than a warp scans at once, a deep reduction, a
// single row and no rows; then determinism, row invariance, untouched empty-group gradients, malformed device
// offsets, and argument checks. Each comparison prints its relative error ||gpu - cpu|| / ||cpu||.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/grouped_gemm.h"
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
using testing::rounded_to_bf16;

constexpr double kF32Unit = 0x1p-24;

// Threshold for two f32 results of a length-L reduction in different orders (the CPU sums in register tiles of its
// own, the GPU in one ascending fma chain): an f32 sum of L random terms has a relative error of about
// u * sqrt(L / 6), so two differ by ~u * sqrt(L); 4x that and at least 1e-6 leaves margin without hiding a wrong
// term (which costs ~1 / sqrt(L)).
double f32_tolerance(int64_t length) { return std::max(1e-6, 4.0 * kF32Unit * std::sqrt(static_cast<double>(length))); }
// Outputs stored in bf16 against the CPU's f32 result on the same bf16-valued inputs: the store rounds each element
// by at most 2^-9 relative; 2^-8 is twice that bound.
constexpr double kBf16OutputTolerance = 0x1p-8;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

Tensor offsets_tensor(const std::vector<int32_t>& offsets) {
  return Tensor::from_vector<int32_t>(offsets, {static_cast<int64_t>(offsets.size())});
}

std::vector<int32_t> offsets_from_sizes(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> offsets{0};
  for (int32_t s : sizes) offsets.push_back(offsets.back() + s);
  return offsets;
}

void expect_close(const Tensor& gpu_result, const Tensor& cpu_result, double tolerance, const std::string& what) {
  const double err = testing::relative_error(gpu_result, cpu_result);
  std::printf("    %-78s relative error %.3e (threshold %.1e)\n", what.c_str(), err, tolerance);
  EXPECT_LE(err, tolerance) << what << ": ||gpu - cpu|| / ||cpu|| = " << err
                            << ", max |gpu - cpu| = " << testing::max_abs_diff(gpu_result, cpu_result);
}

struct GroupCase {
  std::string name;
  std::vector<int32_t> offsets;
  int64_t n_out, n_in;  // N and K of w [G, N, K]
  int64_t groups() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t rows() const { return offsets.back(); }
  int64_t largest_group() const {
    int64_t m = 0;
    for (size_t g = 0; g + 1 < offsets.size(); ++g) m = std::max<int64_t>(m, offsets[g + 1] - offsets[g]);
    return m;
  }
};

std::vector<GroupCase> cases() {
  std::vector<GroupCase> all;
  all.push_back({"empty groups in the middle and at the end", {0, 5, 5, 12, 12}, 7, 9});
  all.push_back({"one group holds all rows", {0, 0, 200, 200}, 53, 29});
  all.push_back({"skewed groups straddling 64-row tiles", offsets_from_sizes({1, 0, 130, 3, 0, 64, 65, 1}), 96, 128});
  Rng rng(77);
  std::vector<int32_t> small(40);
  for (int32_t& s : small) s = static_cast<int32_t>(rng.below(4));
  all.push_back({"40 groups of 0..3 rows (several warp scans)", offsets_from_sizes(small), 37, 53});
  all.push_back({"deep reduction", offsets_from_sizes({100, 300, 0, 124}), 256, 1024});
  all.push_back({"a single row", {0, 1}, 64, 64});
  all.push_back({"no rows at all", {0, 0, 0}, 5, 3});
  return all;
}

struct Inputs {
  Tensor x, w, dy, dw_start;  // f32 on the CPU, bf16-valued when the GPU sees bf16
  Tensor offsets;
};

Inputs make_inputs(const GroupCase& c, DType dtype, uint64_t seed) {
  Rng rng(seed);
  Inputs in;
  in.x = random_tensor({c.rows(), c.n_in}, DType::F32, rng);
  in.w = random_tensor({c.groups(), c.n_out, c.n_in}, DType::F32, rng);
  in.dy = random_tensor({c.rows(), c.n_out}, DType::F32, rng);
  in.dw_start = random_tensor({c.groups(), c.n_out, c.n_in}, DType::F32, rng);
  if (dtype == DType::BF16) {
    in.x = rounded_to_bf16(in.x);
    in.w = rounded_to_bf16(in.w);
    in.dy = rounded_to_bf16(in.dy);
  }
  in.offsets = offsets_tensor(c.offsets);
  return in;
}

std::string label(const char* op, const GroupCase& c, DType dtype) {
  return fmt::format("{} {}: {}", op, dtype_name(dtype), c.name);
}

void check_forward(DType dtype) {
  uint64_t seed = 10;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, dtype, seed++);
    Tensor want = Tensor::empty({c.rows(), c.n_out}, DType::F32);
    ops::grouped_linear_forward(Stream::cpu(), want, in.x, in.w, in.offsets);
    Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, dtype));
    ops::grouped_linear_forward(gpu(), y, on_gpu(in.x.to(dtype)), on_gpu(in.w.to(dtype)), on_gpu(in.offsets));
    expect_close(host_f32(y), want, dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(c.n_in),
                 label("forward", c, dtype));
  }
}

void check_backward_input(DType dtype) {
  uint64_t seed = 20;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, dtype, seed++);
    Tensor want = Tensor::empty({c.rows(), c.n_in}, DType::F32);
    ops::grouped_linear_backward_input(Stream::cpu(), want, in.dy, in.w, in.offsets);
    Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, dtype));
    ops::grouped_linear_backward_input(gpu(), dx, on_gpu(in.dy.to(dtype)), on_gpu(in.w.to(dtype)), on_gpu(in.offsets));
    expect_close(host_f32(dx), want, dtype == DType::BF16 ? kBf16OutputTolerance : f32_tolerance(c.n_out),
                 label("backward_input", c, dtype));
  }
}

// dw (f32) starts from random values: the op accumulates. Products of bf16 values are exact in f32, so bf16
// activations get the f32 threshold too.
void check_backward_weight(DType dtype) {
  uint64_t seed = 30;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, dtype, seed++);
    Tensor want = in.dw_start.clone();
    ops::grouped_linear_backward_weight(Stream::cpu(), want, in.dy, in.x, in.offsets);
    Tensor dw = on_gpu(in.dw_start);
    ops::grouped_linear_backward_weight(gpu(), dw, on_gpu(in.dy.to(dtype)), on_gpu(in.x.to(dtype)), on_gpu(in.offsets));
    const Tensor got = host_f32(dw);
    expect_close(got, want, f32_tolerance(c.largest_group()), label("backward_weight", c, dtype));
    for (int64_t g = 0; g < c.groups(); ++g) {
      if (c.offsets[g] != c.offsets[g + 1]) continue;
      EXPECT_TRUE(bitwise_equal(got.select(g).clone(), in.dw_start.select(g).clone()))
          << c.name << ": empty group " << g << " changed its gradient";
    }
  }
}

TEST(CudaGroupedLinear, ForwardF32MatchesCpu) {
  MT_REQUIRE_GPU();
  check_forward(DType::F32);
}

TEST(CudaGroupedLinear, ForwardBf16MatchesCpuOnRoundedInputs) {
  MT_REQUIRE_GPU();
  check_forward(DType::BF16);
}

TEST(CudaGroupedLinear, BackwardInputF32MatchesCpu) {
  MT_REQUIRE_GPU();
  check_backward_input(DType::F32);
}

TEST(CudaGroupedLinear, BackwardInputBf16MatchesCpuOnRoundedInputs) {
  MT_REQUIRE_GPU();
  check_backward_input(DType::BF16);
}

TEST(CudaGroupedLinear, BackwardWeightF32AccumulatesLikeCpuAndSkipsEmptyGroups) {
  MT_REQUIRE_GPU();
  check_backward_weight(DType::F32);
}

TEST(CudaGroupedLinear, BackwardWeightFromBf16ActivationsAccumulatesInF32) {
  MT_REQUIRE_GPU();
  check_backward_weight(DType::BF16);
}

TEST(CudaGroupedLinear, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (const GroupCase& c : cases()) {
      SCOPED_TRACE(fmt::format("{} {}", dtype_name(dtype), c.name));
      const Inputs in = make_inputs(c, dtype, 40);
      const Tensor x = on_gpu(in.x.to(dtype)), w = on_gpu(in.w.to(dtype)), dy = on_gpu(in.dy.to(dtype));
      const Tensor offsets = on_gpu(in.offsets);
      Tensor results[2][3];
      for (auto& r : results) {
        Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, dtype));
        Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, dtype));
        Tensor dw = on_gpu(in.dw_start);
        ops::grouped_linear_forward(gpu(), y, x, w, offsets);
        ops::grouped_linear_backward_input(gpu(), dx, dy, w, offsets);
        ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets);
        r[0] = y.to(Device::cpu());
        r[1] = dx.to(Device::cpu());
        r[2] = dw.to(Device::cpu());
      }
      EXPECT_TRUE(bitwise_equal(results[0][0], results[1][0])) << "forward";
      EXPECT_TRUE(bitwise_equal(results[0][1], results[1][1])) << "backward_input";
      EXPECT_TRUE(bitwise_equal(results[0][2], results[1][2])) << "backward_weight";
    }
  }
}

// A row's output does not depend on the other rows: group 2 of the skewed case (rows 1..130) computed alone, and its
// last 120 rows alone (other 64-row tile boundaries), give the same bytes as in the full batch.
TEST(CudaGroupedLinear, RowResultDoesNotDependOnTheOtherRows) {
  MT_REQUIRE_GPU();
  const GroupCase c = cases()[2];
  ASSERT_EQ(c.offsets[2], 1);
  ASSERT_EQ(c.offsets[3], 131);
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const Inputs in = make_inputs(c, dtype, 50);
    const Tensor x = on_gpu(in.x.to(dtype)), w = on_gpu(in.w.to(dtype)), dy = on_gpu(in.dy.to(dtype));
    Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, dtype));
    Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, dtype));
    ops::grouped_linear_forward(gpu(), y, x, w, on_gpu(in.offsets));
    ops::grouped_linear_backward_input(gpu(), dx, dy, w, on_gpu(in.offsets));
    const Tensor y_host = y.to(Device::cpu()), dx_host = dx.to(Device::cpu());
    for (int64_t begin : {1, 11}) {
      const int64_t end = 131, count = end - begin;
      // Only group 2 has rows.
      std::vector<int32_t> offsets(c.offsets.size(), static_cast<int32_t>(count));
      offsets[0] = offsets[1] = offsets[2] = 0;
      Tensor y_part = on_gpu(Tensor::zeros({count, c.n_out}, dtype));
      Tensor dx_part = on_gpu(Tensor::zeros({count, c.n_in}, dtype));
      ops::grouped_linear_forward(gpu(), y_part, x.slice(begin, end), w, on_gpu(offsets_tensor(offsets)));
      ops::grouped_linear_backward_input(gpu(), dx_part, dy.slice(begin, end), w, on_gpu(offsets_tensor(offsets)));
      EXPECT_TRUE(bitwise_equal(y_part.to(Device::cpu()), y_host.slice(begin, end).clone()))
          << "forward from row " << begin;
      EXPECT_TRUE(bitwise_equal(dx_part.to(Device::cpu()), dx_host.slice(begin, end).clone()))
          << "backward_input from row " << begin;
    }
  }
}

// Offsets on the device are not validated (that would need a host copy); the kernels clamp them into [0, R], so
// malformed ones give meaningless numbers but never a fault.
TEST(CudaGroupedLinear, MalformedDeviceOffsetsStayInBounds) {
  MT_REQUIRE_GPU();
  const int64_t rows = 12, groups = 4, n_out = 7, n_in = 9;
  Rng rng(60);
  const Tensor x = on_gpu(random_tensor({rows, n_in}, DType::F32, rng));
  const Tensor w = on_gpu(random_tensor({groups, n_out, n_in}, DType::F32, rng));
  const Tensor dy = on_gpu(random_tensor({rows, n_out}, DType::F32, rng));
  const Tensor bad = on_gpu(offsets_tensor({-5, 1 << 30, 3, -(1 << 30), 12}));
  Tensor y = on_gpu(Tensor::zeros({rows, n_out}, DType::F32));
  Tensor dx = on_gpu(Tensor::zeros({rows, n_in}, DType::F32));
  Tensor dw = on_gpu(Tensor::zeros({groups, n_out, n_in}, DType::F32));
  EXPECT_NO_THROW({
    ops::grouped_linear_forward(gpu(), y, x, w, bad);
    ops::grouped_linear_backward_input(gpu(), dx, dy, w, bad);
    ops::grouped_linear_backward_weight(gpu(), dw, dy, x, bad);
    ops::cuda::synchronize(Device::cuda(0));
  });
  // The device is still healthy: a well-formed call afterwards works and matches the CPU.
  const std::vector<int32_t> good{0, 5, 5, 12, 12};
  Tensor want = Tensor::empty({rows, n_out}, DType::F32);
  ops::grouped_linear_forward(Stream::cpu(), want, x.to(Device::cpu()), w.to(Device::cpu()), offsets_tensor(good));
  ops::grouped_linear_forward(gpu(), y, x, w, on_gpu(offsets_tensor(good)));
  expect_close(y.to(Device::cpu()), want, f32_tolerance(n_in), "forward after malformed offsets");
}

TEST(CudaGroupedLinear, RejectsUnsupportedDtypesAndMixedDevices) {
  MT_REQUIRE_GPU();
  Stream& s = gpu();
  const int64_t rows = 12, groups = 4, n_out = 7, n_in = 9;
  const Tensor x = on_gpu(Tensor::zeros({rows, n_in}, DType::F32));
  const Tensor w = on_gpu(Tensor::zeros({groups, n_out, n_in}, DType::F32));
  const Tensor dy = on_gpu(Tensor::zeros({rows, n_out}, DType::F32));
  const Tensor offsets = on_gpu(offsets_tensor({0, 5, 5, 12, 12}));
  Tensor y = on_gpu(Tensor::zeros({rows, n_out}, DType::F32));
  expect_error([&] { ops::grouped_linear_forward(s, y, x, on_gpu(w.to(Device::cpu()).to(DType::F64)), offsets); },
               "grouped_linear_forward: expected w in f32 or bf16 on CUDA but found f64[4, 7, 9] on cuda:0");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, on_gpu(Tensor::zeros({rows, n_in}, DType::BF16)), w, offsets);
      },
      "grouped_linear_forward: x: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, offsets_tensor({0, 5, 5, 12, 12}));
      },
      "grouped_linear_forward: offsets is on the CPU but the stream runs on cuda:0");
  expect_error([&] { ops::grouped_linear_forward(Stream::cpu(), y, x, w, offsets); },
               "grouped_linear_forward: w is on cuda:0 but the stream runs on cpu");
  expect_error(
      [&] {
        ops::grouped_linear_forward(s, y, x, w, on_gpu(offsets_tensor({0, 5, 12, 12})));
      },
      "grouped_linear_forward: offsets: expected shape [5] but found [4]");
  expect_error([&] { ops::grouped_linear_forward(s, y, x, w, on_gpu(Tensor::zeros({5}, DType::I64))); },
               "grouped_linear_forward: offsets: expected dtype i32 but found i64");
  expect_error(
      [&] {
        ops::grouped_linear_backward_weight(s, on_gpu(Tensor::zeros({groups, n_out, n_in}, DType::BF16)), dy, x,
                                            offsets);
      },
      "grouped_linear_backward_weight: dw: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        ops::grouped_linear_backward_weight(s, on_gpu(Tensor::zeros({groups, n_out, n_in}, DType::F32)),
                                            on_gpu(Tensor::zeros({rows, n_out}, DType::BF16)), x, offsets);
      },
      "grouped_linear_backward_weight: dy: expected dtype f32 but found bf16");
}

}  // namespace
}  // namespace moetrain
