// defines: the public elementwise ops: argument validation (shapes, dtypes, contiguity, devices) and dispatch to
// the CPU reference.
#include "ops/elementwise.h"

#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/elementwise.h"

namespace moetrain::ops {

namespace {

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

// A contiguous CPU tensor of f32 or f64 (the dtypes the CPU reference computes in).
void check_float(const Tensor& t, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(t, what);
  require_cpu(t, op);
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
}

void check_like(const Tensor& t, const Tensor& like, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, like.shape(), what);
  expect_dtype(t, like.dtype(), what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

void check_castable(const Tensor& t, const char* op, const char* name) {
  expect_contiguous(t, fmt::format("{}: {}", op, name));
  require_cpu(t, op);
  MT_CHECK(t.dtype() == DType::F64 || t.dtype() == DType::F32 || t.dtype() == DType::BF16,
           "{}: expected {} in f64, f32 or bf16 but found {}", op, name, t.describe());
}

}  // namespace

void add_forward(Stream& stream, Tensor out, const Tensor& a, const Tensor& b) {
  constexpr const char* op = "add_forward";
  check_stream(stream, op);
  check_float(a, op, "a");
  check_like(b, a, op, "b");
  check_like(out, a, op, "out");
  cpu::add_forward(out, a, b);
}

void accumulate(Stream& stream, Tensor acc, const Tensor& x) {
  constexpr const char* op = "accumulate";
  check_stream(stream, op);
  check_float(acc, op, "acc");
  check_like(x, acc, op, "x");
  cpu::accumulate(acc, x);
}

void scale_inplace(Stream& stream, Tensor x, double factor) {
  constexpr const char* op = "scale_inplace";
  check_stream(stream, op);
  check_float(x, op, "x");
  cpu::scale_inplace(x, factor);
}

void cast(Stream& stream, Tensor out, const Tensor& in) {
  constexpr const char* op = "cast";
  check_stream(stream, op);
  check_castable(in, op, "in");
  check_castable(out, op, "out");
  expect_shape(out, in.shape(), fmt::format("{}: out", op));
  cpu::cast(out, in);
}

void round_to_bf16_inplace(Stream& stream, Tensor x) {
  constexpr const char* op = "round_to_bf16_inplace";
  check_stream(stream, op);
  const std::string what = fmt::format("{}: x", op);
  expect_dtype(x, DType::F32, what);
  expect_contiguous(x, what);
  require_cpu(x, op);
  cpu::round_to_bf16_inplace(x);
}

}  // namespace moetrain::ops
