// defines: the CPU reference of SwiGLU (ops/activation.h): y = silu(gate) * up over gate_up [N, 2I], and GPT-OSS's
// clamped variant, rows in parallel.
#pragma once

#include "core/tensor.h"
#include "ops/activation.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::swiglu_forward / ops::swiglu_backward; f32 or f64, contiguous.
void swiglu_forward(const Tensor& y, const Tensor& gate_up);
// Column j of gate and of up are read before either gradient is written, so dgate_up may alias gate_up.
void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up);

// Validated by ops::clamped_swiglu_*; f32 or f64 (alpha and limit are used as the f32 values given, widened for f64).
// The backward may alias dgate_up with gate_up, as swiglu_backward.
void clamped_swiglu_forward(const Tensor& y, const Tensor& gate_up, const ClampedSwigluParams& params);
void clamped_swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params);

// Validated by ops::sigmoid_gate_*; f32 or f64. sigmoid(g) = 1 / (1 + exp(-g)). dx may alias dy (each element's dy is
// read before its dx is written).
void sigmoid_gate_forward(const Tensor& y, const Tensor& x, const Tensor& gate);
void sigmoid_gate_backward(const Tensor& dx, const Tensor& dgate, const Tensor& dy, const Tensor& x,
                           const Tensor& gate);

}  // namespace moetrain::ops::cpu
