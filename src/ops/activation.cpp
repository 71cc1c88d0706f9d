// defines: the public SwiGLU ops: argument validation (gate_up [N, 2I] with an even width, matching y / dy
// [N, I], one float dtype, contiguity, devices) and dispatch to the CPU reference.
#include "ops/activation.h"

#include <cstdint>
#include <string>

#include "ops/cpu/activation.h"
#include "ops/cpu/dispatch.h"

namespace moetrain::ops {

namespace {

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

// Returns I, half the width of gate_up [N, 2I].
int64_t check_gate_up(const Tensor& gate_up, const char* op) {
  expect_contiguous(gate_up, fmt::format("{}: gate_up", op));
  require_cpu(gate_up, op);
  MT_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
           "{}: expected gate_up [N, 2I] with an even width but found {}", op, gate_up.describe());
  MT_CHECK(gate_up.dtype() == DType::F32 || gate_up.dtype() == DType::F64,
           "{}: expected gate_up in f32 or f64 but found {}", op, gate_up.describe());
  return gate_up.size(1) / 2;
}

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

}  // namespace

void swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up) {
  constexpr const char* op = "swiglu_forward";
  check_stream(stream, op);
  const int64_t width = check_gate_up(gate_up, op);
  check_argument(y, {gate_up.size(0), width}, gate_up.dtype(), op, "y [N, I]");
  cpu::swiglu_forward(y, gate_up);
}

void swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up) {
  constexpr const char* op = "swiglu_backward";
  check_stream(stream, op);
  const int64_t width = check_gate_up(gate_up, op);
  check_argument(dy, {gate_up.size(0), width}, gate_up.dtype(), op, "dy [N, I]");
  check_argument(dgate_up, gate_up.shape(), gate_up.dtype(), op, "dgate_up [N, 2I]");
  cpu::swiglu_backward(dgate_up, dy, gate_up);
}

}  // namespace moetrain::ops
