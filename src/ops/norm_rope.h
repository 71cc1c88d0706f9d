// defines: a head's RMSNorm followed by the rotary embedding of its rows (Qwen3's q/k norm, then RoPE), forward and
// backward, each in one pass over the rows where the backend can: the norm's output is rotated before it is stored,
// and the rotation's transpose is applied to the gradient before the norm's input and weight gradients read it.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace moetrain::ops {

// y = rope(rmsnorm(x)) with x, y [T, heads, hd] in one dtype, rstd [T * heads]: the bits of rmsnorm_forward(y, rstd,
// x, w) then rope_forward(y, y) on either backend (the normed rows are rounded to y's dtype before the rotation, as
// the two ops store them). CUDA runs one kernel when the rotation covers whole rows of 64, 128 or 256 elements
// (rotate-half pairs, 16-byte aligned tensors), else the two kernels.
void rmsnorm_rope_forward(Stream& stream, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w,
                          const RmsNormParams& norm, const Tensor& position_ids, const RopeParams& rope);

// The backward of rmsnorm_rope_forward from d_rotated (the gradient of y): with d_normed = rope_backward(d_rotated),
// dx = rmsnorm_backward_input(d_normed) and dw += rmsnorm_backward_weight(d_normed), in one pass where the backend
// can (d_normed is then never stored). dx has the bits of those ops on either backend; dw those of
// rmsnorm_backward_weight on the CPU, and on CUDA the same terms summed in another order fixed by the shape of x.
// dx must not share memory with d_rotated.
void rope_rmsnorm_backward(Stream& stream, Tensor dx, Tensor dw, const Tensor& d_rotated, const Tensor& x,
                           const Tensor& w, const Tensor& rstd, const RmsNormParams& norm, const Tensor& position_ids,
                           const RopeParams& rope);

}  // namespace moetrain::ops
