// defines: RMSNorm forward and backward, plain (scale w) and zero-centred (scale 1 + w, Qwen3.5).
// Applies over the last dimension D of x viewed as [N, D]; the same op serves the per-head q/k norm
// (x [T, nh, hd], w [hd]).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RmsNormParams {
  float eps = 1e-6f;
  bool zero_centered = false;
};

// y = x * rstd * scale, rstd[n] = 1 / sqrt(mean(x[n]^2) + eps). On the CPU every activation (x, y, dy, dx) has one
// float dtype, rstd and w too. On CUDA each activation is f32 or bf16 on its own (an f32 residual stream x with bf16
// outputs y under bf16 compute); rstd, w and dw are f32.
void rmsnorm_forward(Stream& stream, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params);
// The residual add fused with the norm that follows it: sum = a + b (rounded to its dtype, as add_forward writes
// it), then y and rstd as rmsnorm_forward(y, rstd, sum, w) computes them from that rounded sum, in one pass over the
// rows. Same dtypes and shapes as rmsnorm_forward with x = a (b and sum shaped as a; on the CPU typed as a, on CUDA
// each in f32 or bf16: an f32 residual a plus a bf16 mixer output b). sum may alias a or b (the residual updated in
// place); y may alias a or b but not sum; an alias needs one dtype. On the CPU the results are those of add_forward
// then rmsnorm_forward bit for bit; on CUDA those of the two CUDA ops.
void add_rmsnorm_forward(Stream& stream, Tensor sum, Tensor y, Tensor rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, const RmsNormParams& params);
// dx = rstd * (scale*dy - xhat * mean(scale*dy*xhat)), xhat = x * rstd. dx may alias dy of its dtype.
void rmsnorm_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const RmsNormParams& params);
// The input gradient with the residual's gradient added in the same pass: dx = rmsnorm_backward_input(dy) rounded to
// dx's dtype, plus addend (shaped as x, in dx's dtype), rounded again: the bits of rmsnorm_backward_input followed by
// accumulate(dx, addend) on either backend. The addend must not share memory with dx.
void rmsnorm_backward_input_add(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                                const Tensor& rstd, const RmsNormParams& params, const Tensor& addend);
// dw += sum_n dy[n] * xhat[n] (rows summed in ascending order). Same for both variants.
void rmsnorm_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& rstd);
// The norm's whole backward in one pass over the rows where the backend can: dx = rmsnorm_backward_input(dy), plus
// the addend where one is given (as rmsnorm_backward_input_add), and dw += rmsnorm_backward_weight(dy). dx has the
// bits of those ops on either backend; dw those of rmsnorm_backward_weight on the CPU, and on CUDA the same terms
// summed in another order fixed by the shape of x. dx may alias dy (not the addend).
void rmsnorm_backward(Stream& stream, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, const RmsNormParams& params, const Tensor& addend = Tensor());

// The argument checks of rmsnorm_forward and rmsnorm_backward_input, under the name `op`: for the ops that fuse more
// work into those kernels (ops/norm_rope.h).
void check_rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                           const RmsNormParams& params, const char* op);
void check_rmsnorm_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x,
                                  const Tensor& w, const Tensor& rstd, const RmsNormParams& params, const char* op);

}  // namespace moetrain::ops
