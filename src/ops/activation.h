// defines: the SwiGLU activations of the gated MLPs, plain and GPT-OSS's clamped one. gate and up come from one fused
// projection: gate_up [N, 2I] holds gate in columns [0, I) and up in [I, 2I).
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

}  // namespace moetrain::ops
