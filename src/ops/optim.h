// defines: the optimizer math on fp32 master tensors: AdamW (PyTorch's decoupled-decay update),
// the global gradient norm and clipping by it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1 on the first update (bias correction)
  // The gradient-norm clip's coefficient (clip_coefficient), applied to each gradient element as clip_by_global_norm
  // scales it (one f32 product) before the update, so a step needs no pass of its own over the gradients; they are
  // left as they are in memory. 1: no clip.
  double grad_scale = 1.0;
};

// PyTorch's AdamW: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). All tensors share shape and dtype, except that under an f32
// param the two moments may be kept in bf16 (Megatron's precision-aware optimizer does so): each is widened to f32
// when read, updated and used in f32, and rounded to nearest even when stored, so it holds half the bytes and the
// param's update is the f32 one from those stored moments.
void adamw_step(Stream& stream, Tensor param, Tensor exp_avg, Tensor exp_avg_sq, const Tensor& grad,
                const AdamWParams& params);

// AdamW over a list of tensors in one call: for every i, adamw_step(params[i], exp_avg[i], exp_avg_sq[i], grads[i])
// with `hyper` but weight decay weight_decay[i] (hyper.weight_decay is ignored), bit for bit the per-tensor op.
// exp_avg, exp_avg_sq, grads and weight_decay have params.size() entries; each tensor is shaped and typed as
// params[i] (as adamw_step requires), and every moment of the list has one dtype. compute_copies is empty (no
// copies) or has params.size() entries; an entry that is undefined, or the very tensor params[i] (same storage),
// means "no copy"; any other entry is a contiguous tensor of params[i]'s shape on its device, in bf16 or f32 (CPU:
// also f64), that receives the updated param converted with cast's rule (round to nearest even for bf16), which
// replaces a separate cast pass after the step. On CUDA the whole list is ONE kernel launch: a device table of the
// tensors (built on first use and cached while the same tensors come back) is cut into fixed chunks of elements, one
// block per chunk. On the CPU it is the loop over adamw_step followed by cast into each copy.
void adamw_step_multi(Stream& stream, const std::vector<Tensor>& params, const std::vector<Tensor>& exp_avg,
                      const std::vector<Tensor>& exp_avg_sq, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& compute_copies, const std::vector<double>& weight_decay,
                      const AdamWParams& hyper);

// sum of x^2, accumulated in f64 in ascending element order.
double sum_of_squares(Stream& stream, const Tensor& x);
// sqrt(sum over tensors, in list order, of sum_of_squares)
double global_norm(Stream& stream, const std::vector<Tensor>& tensors);
// torch.nn.utils.clip_grad_norm_'s coefficient for a global norm: max_norm / (norm + 1e-6) where that is below 1,
// else 1 (also for max_norm <= 0, which disables the clip, and for a norm that is not finite, which the caller
// acts on).
double clip_coefficient(double norm, double max_norm);
// Scales every tensor by clip_coefficient(norm, max_norm), norm the global norm; returns that norm (before
// clipping).
double clip_by_global_norm(Stream& stream, const std::vector<Tensor>& grads, double max_norm);

}  // namespace moetrain::ops
