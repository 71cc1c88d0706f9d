// defines: the CUDA kernels of the fused q/k norm + rope ops (ops/norm_rope.h).
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::rmsnorm_rope_forward / ops::rope_rmsnorm_backward: [T, heads, hd] activations in
// one dtype (f32 or bf16), w and rstd f32. One kernel when a row of hd elements is one 16-byte span per lane of the
// norm's row layout (hd = 64, 128 or 256: 8, 16 or 32 lanes), the rotation covers the whole head in rotate-half
// pairs and every tensor is 16-byte aligned: a pair's partner span is then Lanes / 2 lanes away, one shuffle. The
// cos and sin come from rope_cos_sin_table. Otherwise the norm and rope kernels in turn. Either way the bits of the
// two ops.
void rmsnorm_rope_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                          const RmsNormParams& norm, const Tensor& position_ids, const RopeParams& rope);
// The backward adds the norm's weight gradient into dw from the same pass (per-block column sums, then
// add_column_sums), in an order that follows from the token and head counts alone; the fallback forms d_normed in a
// temporary.
void rope_rmsnorm_backward(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& d_rotated,
                           const Tensor& x, const Tensor& w, const Tensor& rstd, const RmsNormParams& norm,
                           const Tensor& position_ids, const RopeParams& rope);

}  // namespace moetrain::ops::cuda
