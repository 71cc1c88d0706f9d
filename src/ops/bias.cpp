// defines: the public bias ops: argument validation (y / dy [R, N] in a float dtype of the backend, bias [N] or
// [G, N] in f32 or y's dtype, dbias f32 or f64 with f64 dy, the group offsets, devices, contiguity) and dispatch to
// the backend: the CPU reference (f32 or f64) or the CUDA kernels (f32 or bf16 activations, f32 gradients); and the
// biased linear composed from the public GEMM, bias and cast ops.
#include "ops/bias.h"

#include <cstdint>
#include <string>
#include <utility>

#include "ops/cpu/bias.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/bias.h"
#endif

namespace moetrain::ops {

namespace {

// The activation y or dy: [R, N], contiguous, in a float dtype of its backend (f32 or f64 on the CPU, f32 or bf16
// on CUDA), on the stream's device. Returns {R, N}.
std::pair<int64_t, int64_t> check_rows(const Stream& stream, const Tensor& t, const char* op, const char* name) {
  check_stream_backend(stream, op);
  check_tensor_backend(stream, t, op, name);
  MT_CHECK(t.dim() == 2, "{}: expected {} [R, N] but found {}", op, name, t.describe());
  if (on_cuda(t)) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 on CUDA but found {}",
             op, name, t.describe());
  } else {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
             t.describe());
  }
  expect_contiguous(t, fmt::format("{}: {}", op, name));
  return {t.size(0), t.size(1)};
}

// bias: `shape`, f32 or y's dtype, contiguous, on the stream's device.
void check_bias(const Stream& stream, const Tensor& bias, const Shape& shape, const Tensor& y, const char* op,
                const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(bias, shape, what);
  if (y.dtype() == DType::F32) {
    expect_dtype(bias, DType::F32, what);
  } else {
    MT_CHECK(bias.dtype() == DType::F32 || bias.dtype() == y.dtype(), "{}: expected dtype f32 or y's {} but found {}",
             what, dtype_name(y.dtype()), dtype_name(bias.dtype()));
  }
  expect_contiguous(bias, what);
  check_on_stream_device(stream, bias, op, name);
}

// The gradient accumulates in f32, or in f64 with f64 dy (the CPU reference's gradient checks).
DType gradient_dtype(const Tensor& dy) { return dy.dtype() == DType::F64 ? DType::F64 : DType::F32; }

// offsets: i32 [G + 1], 0 at the start, non-decreasing, R at the end (ops/grouped_gemm.cpp's rules). The values can
// only be checked for CPU offsets: reading device memory here would need a copy and a synchronisation, so for CUDA
// offsets only shape, dtype and device are checked (the kernels clamp the values into [0, R], so bad ones give wrong
// results, never out-of-bounds accesses).
void check_offsets(const Stream& stream, const Tensor& offsets, int64_t groups, int64_t rows, const char* op) {
  check_argument(offsets, {groups + 1}, DType::I32, stream, op, "offsets");
  if (on_cuda(offsets)) return;
  const int32_t* off = offsets.data<int32_t>();
  MT_CHECK(off[0] == 0, "{}: offsets[0] must be 0 but found {}", op, off[0]);
  for (int64_t g = 1; g <= groups; ++g) {
    MT_CHECK(off[g] >= off[g - 1], "{}: offsets must not decrease but offsets[{}] = {} follows offsets[{}] = {}", op, g,
             off[g], g - 1, off[g - 1]);
  }
  MT_CHECK(off[groups] == rows, "{}: the last offset offsets[{}] must equal the row count R = {} but found {}", op,
           groups, rows, off[groups]);
}

// The group count G of a [G, N] bias or gradient.
int64_t check_groups(const Tensor& t, const char* op, const char* name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} [G, N] but found {}", op, name, t.describe());
  return t.size(0);
}

}  // namespace

void bias_add(Stream& stream, Tensor y, const Tensor& bias) {
  constexpr const char* op = "bias_add";
  OpScope profile(stream, "bias", op);
  const auto [rows, width] = check_rows(stream, y, op, "y");
  check_bias(stream, bias, {width}, y, op, "bias [N]");
#if MOETRAIN_HAS_CUDA
  if (on_cuda(y)) {
    cuda::bias_add(stream, y, bias);
    return;
  }
#endif
  cpu::bias_add(y, bias);
}

void bias_backward(Stream& stream, Tensor dbias, const Tensor& dy) {
  constexpr const char* op = "bias_backward";
  OpScope profile(stream, "bias", op);
  const auto [rows, width] = check_rows(stream, dy, op, "dy");
  check_argument(dbias, {width}, gradient_dtype(dy), stream, op, "dbias [N]");
#if MOETRAIN_HAS_CUDA
  if (on_cuda(dy)) {
    cuda::bias_backward(stream, dbias, dy);
    return;
  }
#endif
  cpu::bias_backward(dbias, dy);
}

void grouped_bias_add(Stream& stream, Tensor y, const Tensor& bias, const Tensor& offsets) {
  constexpr const char* op = "grouped_bias_add";
  OpScope profile(stream, "bias", op);
  const auto [rows, width] = check_rows(stream, y, op, "y");
  const int64_t groups = check_groups(bias, op, "bias");
  check_bias(stream, bias, {groups, width}, y, op, "bias [G, N]");
  check_offsets(stream, offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(y)) {
    cuda::grouped_bias_add(stream, y, bias, offsets);
    return;
  }
#endif
  cpu::grouped_bias_add(y, bias, offsets);
}

void grouped_bias_backward(Stream& stream, Tensor dbias, const Tensor& dy, const Tensor& offsets) {
  constexpr const char* op = "grouped_bias_backward";
  OpScope profile(stream, "bias", op);
  const auto [rows, width] = check_rows(stream, dy, op, "dy");
  const int64_t groups = check_groups(dbias, op, "dbias");
  check_argument(dbias, {groups, width}, gradient_dtype(dy), stream, op, "dbias [G, N]");
  check_offsets(stream, offsets, groups, rows, op);
#if MOETRAIN_HAS_CUDA
  if (on_cuda(dy)) {
    cuda::grouped_bias_backward(stream, dbias, dy, offsets);
    return;
  }
#endif
  cpu::grouped_bias_backward(dbias, dy, offsets);
}

void biased_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& bias) {
  if (!bias.defined()) {
    linear_forward(stream, y, x, w);
    return;
  }
  if (y.dtype() != DType::BF16) {
    linear_forward(stream, y, x, w);
    bias_add(stream, y, bias);
    return;
  }
  Tensor wide = Tensor::empty(y.shape(), DType::F32, y.device());
  linear_forward(stream, wide, x, w);
  bias_add(stream, wide, bias);
  cast(stream, y, wide);
}

}  // namespace moetrain::ops
