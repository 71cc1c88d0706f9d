// Tests for the CUDA elementwise kernels (ops/cuda/elementwise.*) through the public ops: add, accumulate and scale
// against the CPU reference bit for bit in f32 and against one rounding in bf16, casts between f64 / f32 / bf16 and
// in-place bf16 rounding bit for bit against the CPU (NaN, infinities, ties, subnormals included), determinism and
// argument checks. Run on a GPU; skipped elsewhere.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;

// Index of the first differing element (by bytes), or -1 when a and b hold the same bytes.
int64_t first_difference(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype()) return 0;
  const size_t size = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw_data());
  const auto* pb = static_cast<const unsigned char*>(b.raw_data());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * size, pb + i * size, size) != 0) return i;
  }
  return -1;
}

// Fails with the first differing element, printed as f64, when the host tensors differ in any byte.
void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  const int64_t i = first_difference(got, want);
  if (i < 0) return;
  ADD_FAILURE() << what << ": " << got.describe() << " differs from " << want.describe() << " first at element " << i
                << ": got " << got.to(DType::F64).to_vector<double>()[i] << ", want "
                << want.to(DType::F64).to_vector<double>()[i];
}

// f32 values that exercise the bf16 rounding: ties to even both ways, just above a tie, the largest finite values
// (one rounds to infinity), subnormals, signed zeros, infinities and NaNs with payloads; then random normals.
Tensor special_f32(int64_t random_count, Rng& rng) {
  std::vector<float> v = {1.0f + 0x1p-8f,
                          1.0f + 3 * 0x1p-8f,
                          1.0f + 0x1p-8f + 0x1p-20f,
                          -(1.0f + 0x1p-8f),
                          3.0f,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::bit_cast<float>(0x7f7f7fffu),
                          std::numeric_limits<float>::denorm_min(),
                          std::bit_cast<float>(0x00018000u),
                          0.0f,
                          -0.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::bit_cast<float>(0x7fc00001u),
                          std::bit_cast<float>(0xff812345u),
                          std::bit_cast<float>(0x7f800001u)};
  for (int64_t i = 0; i < random_count; ++i) v.push_back(static_cast<float>(rng.normal() * 100.0));
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

TEST(CudaElementwise, AddAccumulateAndScaleMatchCpuBitwiseInF32) {
  MT_REQUIRE_GPU();
  // One f32 operation per element on both sides: the results must be the same bits.
  for (const Shape& shape : {Shape{1}, Shape{3, 7}, Shape{1000, 129}, Shape{0, 5}}) {
    SCOPED_TRACE(shape_str(shape));
    Rng rng(11);
    const Tensor a = random_tensor(shape, DType::F32, rng), b = random_tensor(shape, DType::F32, rng);
    Tensor want = Tensor::empty(shape, DType::F32);
    ops::add_forward(Stream::cpu(), want, a, b);
    Tensor got = Tensor::empty(shape, DType::F32, Device::cuda(0));
    ops::add_forward(gpu(), got, on_gpu(a), on_gpu(b));
    expect_same_bytes(on_cpu(got), want, "add_forward");

    Tensor acc_cpu = a.clone();
    ops::accumulate(Stream::cpu(), acc_cpu, b);
    Tensor acc_gpu = on_gpu(a);
    ops::accumulate(gpu(), acc_gpu, on_gpu(b));
    expect_same_bytes(on_cpu(acc_gpu), acc_cpu, "accumulate");

    Tensor scaled_cpu = a.clone();
    ops::scale_inplace(Stream::cpu(), scaled_cpu, 0.3);
    Tensor scaled_gpu = on_gpu(a);
    ops::scale_inplace(gpu(), scaled_gpu, 0.3);
    expect_same_bytes(on_cpu(scaled_gpu), scaled_cpu, "scale_inplace");
  }
}

TEST(CudaElementwise, AddMayWriteIntoAnInput) {
  MT_REQUIRE_GPU();
  Rng rng(12);
  const Tensor a = random_tensor({777}, DType::F32, rng), b = random_tensor({777}, DType::F32, rng);
  Tensor want = Tensor::empty({777}, DType::F32);
  ops::add_forward(Stream::cpu(), want, a, b);
  Tensor into_a = on_gpu(a);
  ops::add_forward(gpu(), into_a, into_a, on_gpu(b));
  expect_same_bytes(on_cpu(into_a), want, "out aliasing a");
  Tensor into_b = on_gpu(b);
  ops::add_forward(gpu(), into_b, on_gpu(a), into_b);
  expect_same_bytes(on_cpu(into_b), want, "out aliasing b");
}

TEST(CudaElementwise, Bf16ArithmeticRoundsTheF32ResultOnce) {
  MT_REQUIRE_GPU();
  // bf16 tensors compute in f32 and round once to nearest even: the expected values are exactly that, per element.
  Rng rng(13);
  const int64_t n = 4099;
  const Tensor a16 = random_tensor({n}, DType::F32, rng).to(DType::BF16);
  const Tensor b16 = random_tensor({n}, DType::F32, rng).to(DType::BF16);
  const std::vector<float> a = a16.to(DType::F32).to_vector<float>(), b = b16.to(DType::F32).to_vector<float>();
  const float factor = static_cast<float>(-1.7);
  std::vector<float> sum(n), scaled(n);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = round_to_bf16(a[i] + b[i]);
    scaled[i] = round_to_bf16(a[i] * factor);
  }
  Tensor out = Tensor::empty({n}, DType::BF16, Device::cuda(0));
  ops::add_forward(gpu(), out, on_gpu(a16), on_gpu(b16));
  expect_same_bytes(on_cpu(out).to(DType::F32), Tensor::from_vector(sum, {n}), "bf16 add_forward");
  Tensor acc = on_gpu(a16);
  ops::accumulate(gpu(), acc, on_gpu(b16));
  expect_same_bytes(on_cpu(acc).to(DType::F32), Tensor::from_vector(sum, {n}), "bf16 accumulate");
  Tensor x = on_gpu(a16);
  ops::scale_inplace(gpu(), x, -1.7);
  expect_same_bytes(on_cpu(x).to(DType::F32), Tensor::from_vector(scaled, {n}), "bf16 scale_inplace");
}

TEST(CudaElementwise, CastMatchesCpuBitwiseForEveryDtypePair) {
  MT_REQUIRE_GPU();
  Rng rng(14);
  const Tensor f32 = special_f32(5000, rng);
  // f64 sources with bits below f32 precision, so f64 -> bf16 shows its rounding through f32.
  std::vector<double> f64_values = f32.to(DType::F64).to_vector<double>();
  for (size_t i = 0; i < f64_values.size(); ++i) {
    if (std::isfinite(f64_values[i])) f64_values[i] *= 1.0 + 0x1p-30 * static_cast<double>(i % 7);
  }
  const Tensor f64 = Tensor::from_vector(f64_values, f32.shape());
  const Tensor bf16 = f32.to(DType::BF16);
  for (const Tensor& in : {f64, f32, bf16}) {
    for (DType to : {DType::F64, DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(dtype_name(in.dtype())) + " -> " + std::string(dtype_name(to)));
      Tensor want = Tensor::empty(in.shape(), to);
      ops::cast(Stream::cpu(), want, in);
      Tensor got = Tensor::empty(in.shape(), to, Device::cuda(0));
      ops::cast(gpu(), got, on_gpu(in));
      const Tensor host = on_cpu(got);
      const int64_t i = first_difference(host, want);
      EXPECT_EQ(i, -1) << "first difference at element " << i << " (input element bits of the f32 source 0x" << std::hex
                       << (i >= 0 ? std::bit_cast<uint32_t>(f32.to_vector<float>()[i]) : 0u) << ")";
    }
  }
}

TEST(CudaElementwise, RoundToBf16InplaceMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(15);
  const Tensor x = special_f32(10000, rng);
  Tensor want = x.clone();
  ops::round_to_bf16_inplace(Stream::cpu(), want);
  Tensor got = on_gpu(x);
  ops::round_to_bf16_inplace(gpu(), got);
  const Tensor host = on_cpu(got);
  const int64_t i = first_difference(host, want);
  EXPECT_EQ(i, -1) << "first difference at element " << i << ": input bits 0x" << std::hex
                   << (i >= 0 ? std::bit_cast<uint32_t>(x.to_vector<float>()[i]) : 0u) << ", got 0x"
                   << (i >= 0 ? std::bit_cast<uint32_t>(host.to_vector<float>()[i]) : 0u) << ", want 0x"
                   << (i >= 0 ? std::bit_cast<uint32_t>(want.to_vector<float>()[i]) : 0u);
}

TEST(CudaElementwise, RepeatedRunsGiveIdenticalBits) {
  MT_REQUIRE_GPU();
  Rng rng(16);
  const Tensor a = on_gpu(random_tensor({100003}, DType::F32, rng).to(DType::BF16));
  const Tensor b = on_gpu(random_tensor({100003}, DType::F32, rng).to(DType::BF16));
  Tensor first = Tensor::empty({100003}, DType::BF16, Device::cuda(0));
  Tensor second = Tensor::empty({100003}, DType::BF16, Device::cuda(0));
  ops::add_forward(gpu(), first, a, b);
  ops::add_forward(gpu(), second, a, b);
  EXPECT_EQ(first_difference(on_cpu(first), on_cpu(second)), -1);
}

TEST(CudaElementwise, RejectsMixedDevicesAndDtypesWithoutAKernel) {
  MT_REQUIRE_GPU();
  const Tensor a = Tensor::zeros({4}, DType::F32, Device::cuda(0));
  Tensor out = Tensor::zeros({4}, DType::F32, Device::cuda(0));
  const Tensor host = Tensor::zeros({4}, DType::F32);
  expect_error([&] { ops::add_forward(gpu(), out, a, host); },
               {"add_forward", "b", "stream's device cuda:0", "on cpu"});
  expect_error([&] { ops::add_forward(Stream::cpu(), out, a, a); },
               {"add_forward", "a", "stream's device cpu", "on cuda:0"});
  Tensor f64 = Tensor::zeros({4}, DType::F64, Device::cuda(0));
  expect_error([&] { ops::scale_inplace(gpu(), f64, 2.0); }, {"scale_inplace", "f32 or bf16", "f64"});
  Tensor bf16 = Tensor::zeros({4}, DType::BF16, Device::cuda(0));
  expect_error([&] { ops::round_to_bf16_inplace(gpu(), bf16); }, {"round_to_bf16_inplace", "f32", "bf16"});
  Tensor i32 = Tensor::zeros({4}, DType::I32, Device::cuda(0));
  expect_error([&] { ops::cast(gpu(), i32, a); }, {"cast", "out", "f64, f32 or bf16", "i32"});
}

}  // namespace
}  // namespace moetrain
