// defines: the public fused q/k norm + rope ops: the argument checks of the two ops they fuse, and dispatch to the
// CUDA kernels or to the CPU reference's two ops in turn.
#include "ops/norm_rope.h"

#include "ops/cpu/norm.h"
#include "ops/cpu/rope.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/norm_rope.h"
#endif

namespace moetrain::ops {

void rmsnorm_rope_forward(Stream& stream, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w,
                          const RmsNormParams& norm, const Tensor& position_ids, const RopeParams& rope) {
  constexpr const char* op = "rmsnorm_rope_forward";
  OpScope profile(stream, "norm", op);
  check_rmsnorm_forward(stream, y, rstd, x, w, norm, op);
  check_rope_arguments(y, x, position_ids, rope, stream, op, "y", "x");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_rope_forward(stream, y, rstd, x, w, norm, position_ids, rope);
    return;
  }
#endif
  cpu::rmsnorm_forward(y, rstd, x, w, norm);
  cpu::rope_forward(y, y, position_ids, rope);
}

void rope_rmsnorm_backward(Stream& stream, Tensor dx, Tensor dw, const Tensor& d_rotated, const Tensor& x,
                           const Tensor& w, const Tensor& rstd, const RmsNormParams& norm, const Tensor& position_ids,
                           const RopeParams& rope) {
  constexpr const char* op = "rope_rmsnorm_backward";
  OpScope profile(stream, "norm", op);
  check_rope_arguments(dx, d_rotated, position_ids, rope, stream, op, "dx", "d_rotated");
  check_rmsnorm_backward_input(stream, dx, d_rotated, x, w, rstd, norm, op);
  check_argument(dw, w.shape(), w.dtype(), stream, op, "dw");
  MT_CHECK(!share_memory(dx, d_rotated), "{}: expected dx {} apart from d_rotated {}", op, dx.describe(),
           d_rotated.describe());
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rope_rmsnorm_backward(stream, dx, dw, d_rotated, x, w, rstd, norm, position_ids, rope);
    return;
  }
#endif
  const Tensor d_normed = Tensor::empty(d_rotated.shape(), d_rotated.dtype());
  cpu::rope_backward(d_normed, d_rotated, position_ids, rope);
  cpu::rmsnorm_backward_input(dx, d_normed, x, w, rstd, norm);
  cpu::rmsnorm_backward_weight(dw, d_normed, x, rstd);
}

}  // namespace moetrain::ops
