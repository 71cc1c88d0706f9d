// defines: the public elementwise ops: argument validation (shapes, dtypes, contiguity, devices) and dispatch to the
// backend of the stream's device: the CPU reference, or the CUDA kernels for tensors on a CUDA device.
#include "ops/elementwise.h"

#include <string>

#include "ops/cpu/elementwise.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/elementwise.h"
#endif

namespace moetrain::ops {

namespace {

// A contiguous tensor of a dtype the backend computes in: f32 or f64 on the CPU, f32 or bf16 on CUDA.
void check_float(const Tensor& t, const Stream& stream, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(t, what);
  check_on_stream_device(stream, t, op, name);
  if (stream.device().is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 (CUDA) but found {}",
             op, name, t.describe());
    return;
  }
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
}

void check_castable(const Tensor& t, const Stream& stream, const char* op, const char* name) {
  expect_contiguous(t, fmt::format("{}: {}", op, name));
  check_on_stream_device(stream, t, op, name);
  MT_CHECK(t.dtype() == DType::F64 || t.dtype() == DType::F32 || t.dtype() == DType::BF16,
           "{}: expected {} in f64, f32 or bf16 but found {}", op, name, t.describe());
}

// The addend of add_forward and accumulate: shaped as the sum; on the CPU in its dtype, on CUDA in f32 or bf16 (a
// bf16 activation added into an f32 residual stream under bf16 compute).
void check_addend(const Tensor& t, const Tensor& sum, const Stream& stream, const char* op, const char* name) {
  if (stream.device().is_cuda()) {
    check_float(t, stream, op, name);
    check_argument(t, sum.shape(), t.dtype(), stream, op, name);
    return;
  }
  check_like(t, sum, stream, op, name);
}

}  // namespace

void add_forward(Stream& stream, Tensor out, const Tensor& a, const Tensor& b) {
  constexpr const char* op = "add_forward";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  check_float(a, stream, op, "a");
  check_addend(b, a, stream, op, "b");
  check_like(out, a, stream, op, "out");
  MT_CHECK(out.numel() == 0 || out.raw_data() != b.raw_data() || out.dtype() == b.dtype(),
           "{}: out may overwrite b only in the same dtype, but out is {} and b is {}", op, dtype_name(out.dtype()),
           dtype_name(b.dtype()));
#if MOETRAIN_HAS_CUDA
  if (a.device().is_cuda()) {
    cuda::add_forward(stream, out, a, b);
    return;
  }
#endif
  cpu::add_forward(out, a, b);
}

void accumulate(Stream& stream, Tensor acc, const Tensor& x) {
  constexpr const char* op = "accumulate";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  check_float(acc, stream, op, "acc");
  check_addend(x, acc, stream, op, "x");
#if MOETRAIN_HAS_CUDA
  if (acc.device().is_cuda()) {
    cuda::accumulate(stream, acc, x);
    return;
  }
#endif
  cpu::accumulate(acc, x);
}

void scale_inplace(Stream& stream, Tensor x, double factor) {
  constexpr const char* op = "scale_inplace";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  check_float(x, stream, op, "x");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::scale_inplace(stream, x, factor);
    return;
  }
#endif
  cpu::scale_inplace(x, factor);
}

void cast(Stream& stream, Tensor out, const Tensor& in) {
  constexpr const char* op = "cast";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  check_castable(in, stream, op, "in");
  check_castable(out, stream, op, "out");
  expect_shape(out, in.shape(), fmt::format("{}: out", op));
#if MOETRAIN_HAS_CUDA
  if (in.device().is_cuda()) {
    cuda::cast(stream, out, in);
    return;
  }
#endif
  cpu::cast(out, in);
}

Tensor in_dtype(Stream& stream, const Tensor& in, DType dtype) {
  if (in.dtype() == dtype) return in;
  Tensor out = Tensor::empty(in.shape(), dtype, in.device());
  cast(stream, out, in);
  return out;
}

void round_to_bf16_inplace(Stream& stream, Tensor x) {
  constexpr const char* op = "round_to_bf16_inplace";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  const std::string what = fmt::format("{}: x", op);
  expect_dtype(x, DType::F32, what);
  expect_contiguous(x, what);
  check_on_stream_device(stream, x, op, "x");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::round_to_bf16_inplace(stream, x);
    return;
  }
#endif
  cpu::round_to_bf16_inplace(x);
}

}  // namespace moetrain::ops
