// defines: the CPU reference of the attention sinks (ops/attention.h): the rescale of attention_forward's out and lse
// by a per-head sink logit, and the sink gradient, in f32 or f64.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::attention_sinks_forward / ops::attention_sinks_backward: out / dout
// [T, nh, hdv], lse [T, nh], sinks / dsinks [nh], all in one dtype (f32 or f64).
void attention_sinks_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks);
// dsinks[h] += -(sum over t ascending of exp(sinks[h] - lse[t, h]) * <dout[t, h, :], out[t, h, :]>).
void attention_sinks_backward(const Tensor& dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& sinks);

}  // namespace moetrain::ops::cpu
