// defines: the public SwiGLU ops, plain and clamped: argument validation (gate_up [N, 2I] with an even width, matching
// y / dy [N, I], one float dtype, contiguity, devices, the clamped activation's alpha and limit) and dispatch to the
// backend of the stream's device: the CPU reference, or the CUDA kernels.
#include "ops/activation.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/activation.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/activation.h"
#endif

namespace moetrain::ops {

namespace {

// Returns I, half the width of gate_up [N, 2I].
// The CPU reference computes in f32 or f64, the CUDA kernels in f32 from f32 or bf16 tensors.
int64_t check_gate_up(const Tensor& gate_up, const Stream& stream, const char* op) {
  expect_contiguous(gate_up, fmt::format("{}: gate_up", op));
  check_on_stream_device(stream, gate_up, op, "gate_up");
  MT_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
           "{}: expected gate_up [N, 2I] with an even width but found {}", op, gate_up.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(gate_up.dtype() == DType::F32 || gate_up.dtype() == DType::BF16,
             "{}: expected gate_up in f32 or bf16 (CUDA) but found {}", op, gate_up.describe());
  } else {
    MT_CHECK(gate_up.dtype() == DType::F32 || gate_up.dtype() == DType::F64,
             "{}: expected gate_up in f32 or f64 but found {}", op, gate_up.describe());
  }
  return gate_up.size(1) / 2;
}

}  // namespace

void check_clamped_swiglu_params(const ClampedSwigluParams& params, const std::string& what) {
  MT_CHECK(std::isfinite(params.alpha), "{}: alpha ({}) must be finite", what, params.alpha);
  MT_CHECK(std::isfinite(params.limit) && params.limit > 0.0f, "{}: limit ({}) must be finite and > 0", what,
           params.limit);
}

void swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up) {
  constexpr const char* op = "swiglu_forward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  const int64_t width = check_gate_up(gate_up, stream, op);
  check_argument(y, {gate_up.size(0), width}, gate_up.dtype(), stream, op, "y [N, I]");
#if MOETRAIN_HAS_CUDA
  if (gate_up.device().is_cuda()) {
    cuda::swiglu_forward(stream, y, gate_up);
    return;
  }
#endif
  cpu::swiglu_forward(y, gate_up);
}

void swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up) {
  constexpr const char* op = "swiglu_backward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  const int64_t width = check_gate_up(gate_up, stream, op);
  check_argument(dy, {gate_up.size(0), width}, gate_up.dtype(), stream, op, "dy [N, I]");
  check_argument(dgate_up, gate_up.shape(), gate_up.dtype(), stream, op, "dgate_up [N, 2I]");
#if MOETRAIN_HAS_CUDA
  if (gate_up.device().is_cuda()) {
    cuda::swiglu_backward(stream, dgate_up, dy, gate_up);
    return;
  }
#endif
  cpu::swiglu_backward(dgate_up, dy, gate_up);
}

void clamped_swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up, const ClampedSwigluParams& params) {
  constexpr const char* op = "clamped_swiglu_forward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  check_clamped_swiglu_params(params, op);
  const int64_t width = check_gate_up(gate_up, stream, op);
  check_argument(y, {gate_up.size(0), width}, gate_up.dtype(), stream, op, "y [N, I]");
#if MOETRAIN_HAS_CUDA
  if (gate_up.device().is_cuda()) {
    cuda::clamped_swiglu_forward(stream, y, gate_up, params);
    return;
  }
#endif
  cpu::clamped_swiglu_forward(y, gate_up, params);
}

void clamped_swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params) {
  constexpr const char* op = "clamped_swiglu_backward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  check_clamped_swiglu_params(params, op);
  const int64_t width = check_gate_up(gate_up, stream, op);
  check_argument(dy, {gate_up.size(0), width}, gate_up.dtype(), stream, op, "dy [N, I]");
  check_argument(dgate_up, gate_up.shape(), gate_up.dtype(), stream, op, "dgate_up [N, 2I]");
#if MOETRAIN_HAS_CUDA
  if (gate_up.device().is_cuda()) {
    cuda::clamped_swiglu_backward(stream, dgate_up, dy, gate_up, params);
    return;
  }
#endif
  cpu::clamped_swiglu_backward(dgate_up, dy, gate_up, params);
}

namespace {

// Checks x [N, D] and gate [N, D] or [N, 1] of one float dtype on the stream's device; returns gate's width.
int64_t check_sigmoid_gate(const Tensor& x, const Tensor& gate, const Stream& stream, const char* op) {
  expect_contiguous(x, fmt::format("{}: x", op));
  check_on_stream_device(stream, x, op, "x");
  MT_CHECK(x.dim() == 2, "{}: expected x [N, D] but found {}", op, x.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, "{}: expected x in f32 or bf16 (CUDA) but found {}",
             op, x.describe());
  } else {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F64, "{}: expected x in f32 or f64 but found {}", op,
             x.describe());
  }
  MT_CHECK(gate.dim() == 2 && gate.size(0) == x.size(0) && (gate.size(1) == x.size(1) || gate.size(1) == 1),
           "{}: expected gate [N, D] or [N, 1] for x {} but found {}", op, x.describe(), gate.describe());
  check_argument(gate, gate.shape(), x.dtype(), stream, op, "gate [N, D] or [N, 1]");
  return gate.size(1);
}

}  // namespace

void sigmoid_gate_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& gate) {
  constexpr const char* op = "sigmoid_gate_forward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  check_sigmoid_gate(x, gate, stream, op);
  check_argument(y, x.shape(), x.dtype(), stream, op, "y [N, D]");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::sigmoid_gate_forward(stream, y, x, gate);
    return;
  }
#endif
  cpu::sigmoid_gate_forward(y, x, gate);
}

void sigmoid_gate_backward(Stream& stream, Tensor dx, Tensor dgate, const Tensor& dy, const Tensor& x,
                           const Tensor& gate) {
  constexpr const char* op = "sigmoid_gate_backward";
  OpScope profile(stream, "activation", op);
  check_stream_backend(stream, op);
  check_sigmoid_gate(x, gate, stream, op);
  check_argument(dy, x.shape(), x.dtype(), stream, op, "dy [N, D]");
  check_argument(dx, x.shape(), x.dtype(), stream, op, "dx [N, D]");
  check_argument(dgate, gate.shape(), x.dtype(), stream, op, "dgate (gate's shape)");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::sigmoid_gate_backward(stream, dx, dgate, dy, x, gate);
    return;
  }
#endif
  cpu::sigmoid_gate_backward(dx, dgate, dy, x, gate);
}

}  // namespace moetrain::ops
