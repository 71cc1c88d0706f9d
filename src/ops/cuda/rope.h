// defines: the CUDA kernels of the rope ops (ops/rope.h): rotate-half and interleaved pairs, partial rotary, with
// the frequencies passed in the kernel's parameters (no device buffer, no host synchronisation).
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/rope.h"

namespace moetrain::ops::cuda {

// The most frequencies (rotary_dim / 2) the kernel parameters carry; ops::rope_* reject larger rotary dims on CUDA.
constexpr int kRopeMaxFrequencies = 256;

// Arguments validated by ops::rope_*: x / y (dy / dx) [T, heads, hd] contiguous on the stream's device, one dtype,
// f32 or bf16 (computed in f32); position_ids i32 [T]. Positions are not checked for >= 0 on the device (that needs
// the values on the host); a negative one just rotates the other way. The angle is f32(position) * inv_freq[i] in
// f32, as on the CPU, but its cos and sin come from cosf / sinf in f32 where the CPU rounds double results: c and s
// may differ from the CPU's by an ulp or two; the rotation is then the CPU's (each product and sum rounded to f32). y
// may alias x (dx may alias dy).
void rope_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& position_ids,
                  const RopeParams& params);
void rope_backward(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& position_ids,
                   const RopeParams& params);

// The c and s of every (token, pair) as rope_forward computes them (c = cos * scaling, s = sin * scaling, unsigned):
// table f32 [2, T, rotary_dim / 2], c then s, for kernels that rotate rows of their own (ops/cuda/norm_rope.h).
void rope_cos_sin_table(const Stream& stream, const Tensor& table, const Tensor& position_ids,
                        const RopeParams& params);

}  // namespace moetrain::ops::cuda
