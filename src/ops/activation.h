// defines: the SwiGLU activations of the gated MLPs, plain and GPT-OSS's clamped one. gate and up come from one fused
// projection: gate_up [N, 2I] holds gate in columns [0, I) and up in [I, 2I). And the sigmoid gate of Qwen3.5
// (y = x * sigmoid(gate): the attention's output gate, the shared expert's gate).
#pragma once

#include <string>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// y [N, I] = silu(gate) * up
void swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up);
// dgate_up [N, 2I] from dy [N, I]
void swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up);

// GPT-OSS's expert activation (transformers 5.17 GptOssExperts._apply_gate):
//   g = min(gate, limit), u = clamp(up, -limit, limit), y = (u + 1) * g * sigmoid(alpha * g).
// alpha must be finite, limit finite and > 0.
struct ClampedSwigluParams {
  float alpha = 1.702f;
  float limit = 7.0f;
};
// Refuses, prefixing `what`, an alpha that is not finite and a limit that is not finite and > 0. The ops run it on
// every call; blocks run it when they are built.
void check_clamped_swiglu_params(const ClampedSwigluParams& params, const std::string& what);

// y [N, I] from gate_up [N, 2I]
void clamped_swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up, const ClampedSwigluParams& params);
// dgate_up [N, 2I] from dy [N, I]. The clamps pass the gradient as the clamp backward of torch 2.15 (the golden
// reference's) does: strictly inside, min < x < max; at the limit itself and beyond it the gradient is 0.
void clamped_swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up,
                             const ClampedSwigluParams& params);

// y = x * sigmoid(gate), as torch's `x * torch.sigmoid(gate)`: x, y [N, D]; gate [N, D] (one gate per element, the
// attention's output gate) or [N, 1] (one per row, broadcast over it: the shared expert's gate). One float dtype.
void sigmoid_gate_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& gate);
// dx = dy * sigmoid(gate) (overwritten; may alias dy) and dgate = (dy * x) * s * (1 - s), s = sigmoid(gate)
// (overwritten), where a row gate [N, 1] first sums dy * x over its row in a fixed order (the CPU in ascending
// columns; CUDA one warp per row, lane-strided partial sums and a fixed butterfly).
void sigmoid_gate_backward(Stream& stream, Tensor dx, Tensor dgate, const Tensor& dy, const Tensor& x,
                           const Tensor& gate);

}  // namespace moetrain::ops
