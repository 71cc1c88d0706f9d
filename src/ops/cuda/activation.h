// defines: the CUDA kernels of the SwiGLU ops (ops/activation.h), plain and clamped: one thread per output element.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/activation.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::swiglu_*: contiguous, on the stream's device, gate_up [N, 2I] (gate in columns
// [0, I), up in [I, 2I)), y / dy [N, I], dgate_up [N, 2I], one dtype, f32 or bf16 (computed in f32). The formulas are
// ops/cpu/activation.cpp's with expf (CUDA's expf is within 2 ulp, the CPU's std::exp within 1).
void swiglu_forward(const Stream& stream, const Tensor& y, const Tensor& gate_up);
void swiglu_backward(const Stream& stream, const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up);

// The clamped variant (GPT-OSS), validated by ops::clamped_swiglu_*; the formulas of ops/cpu/activation.cpp in f32.
void clamped_swiglu_forward(const Stream& stream, const Tensor& y, const Tensor& gate_up,
                            const ClampedSwigluParams& params);
void clamped_swiglu_backward(const Stream& stream, const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params);

// The sigmoid gate, validated by ops::sigmoid_gate_*: x, y, dy, dx [N, D], gate, dgate [N, D] or [N, 1], one dtype,
// f32 or bf16 (computed in f32). A row gate's backward sums dy * x over the row in ascending order in one thread, as
// the CPU does.
void sigmoid_gate_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& gate);
void sigmoid_gate_backward(const Stream& stream, const Tensor& dx, const Tensor& dgate, const Tensor& dy,
                           const Tensor& x, const Tensor& gate);

}  // namespace moetrain::ops::cuda
