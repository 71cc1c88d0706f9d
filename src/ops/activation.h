// defines: the SwiGLU activation of the gated MLPs. gate and up come from one fused projection:
// gate_up [N, 2I] holds gate in columns [0, I) and up in [I, 2I).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// y [N, I] = silu(gate) * up
void swiglu_forward(Stream& stream, Tensor y, const Tensor& gate_up);
// dgate_up [N, 2I] from dy [N, I]
void swiglu_backward(Stream& stream, Tensor dgate_up, const Tensor& dy, const Tensor& gate_up);

}  // namespace moetrain::ops
