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
};

// PyTorch's AdamW: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). All tensors share shape and dtype.
void adamw_step(Stream& stream, Tensor param, Tensor exp_avg, Tensor exp_avg_sq, const Tensor& grad,
                const AdamWParams& params);

// sum of x^2, accumulated in f64 in ascending element order.
double sum_of_squares(Stream& stream, const Tensor& x);
// sqrt(sum over tensors, in list order, of sum_of_squares)
double global_norm(Stream& stream, const std::vector<Tensor>& tensors);
// Scales every tensor by min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does,
// where norm is the global norm; returns that norm (before clipping). max_norm <= 0 disables it.
double clip_by_global_norm(Stream& stream, const std::vector<Tensor>& grads, double max_norm);

}  // namespace moetrain::ops
