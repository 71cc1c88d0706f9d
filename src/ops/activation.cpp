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
  OpScope profile(stream, "activation");
  constexpr const char* op = "swiglu_forward";
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
  OpScope profile(stream, "activation");
  constexpr const char* op = "swiglu_backward";
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
  OpScope profile(stream, "activation");
  constexpr const char* op = "clamped_swiglu_forward";
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
  OpScope profile(stream, "activation");
  constexpr const char* op = "clamped_swiglu_backward";
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

}  // namespace moetrain::ops
