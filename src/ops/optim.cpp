// defines: the public optimizer ops: argument validation (shapes, dtypes, contiguity, devices, hyper-parameter
// ranges) and dispatch to the backend of the stream's device (the CPU reference, or the CUDA kernels); the global
// norm and clipping are composed here from it.
#include "ops/optim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/cpu/elementwise.h"
#include "ops/cpu/optim.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/elementwise.h"
#include "ops/cuda/optim.h"
#endif

namespace moetrain::ops {

namespace {

// A contiguous tensor on the stream's device, f32 or f64 on the CPU, f32 on CUDA (optimizer state and gradients are
// f32 there); `name` may carry an index ("grads[3]").
void check_float(const Tensor& t, const Stream& stream, const char* op, const std::string& name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(t, what);
  check_on_stream_device(stream, t, op, name);
  if (stream.device().is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32, "{}: expected {} in f32 (CUDA) but found {}", op, name, t.describe());
    return;
  }
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
}

// The moments of `param`: its shape, contiguous on the stream's device, both in one dtype: the param's, or bf16
// under an f32 param (moments kept in bf16, ops/optim.h).
void check_moments(const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& param, const Stream& stream,
                   const char* op, const std::string& suffix) {
  const DType moments = exp_avg.dtype();
  MT_CHECK(moments == param.dtype() || (moments == DType::BF16 && param.dtype() == DType::F32),
           "{}: expected exp_avg{} in {} (the param's dtype) or in bf16 under an f32 param but found {}", op, suffix,
           dtype_name(param.dtype()), exp_avg.describe());
  check_argument(exp_avg, param.shape(), moments, stream, op, "exp_avg" + suffix);
  check_argument(exp_avg_sq, param.shape(), moments, stream, op, "exp_avg_sq" + suffix);
}

void check_adamw_params(const AdamWParams& p, const char* op) {
  MT_CHECK(std::isfinite(p.lr) && p.lr >= 0.0, "{}: expected lr >= 0 but found {}", op, p.lr);
  MT_CHECK(p.beta1 >= 0.0 && p.beta1 < 1.0, "{}: expected beta1 in [0, 1) but found {}", op, p.beta1);
  MT_CHECK(p.beta2 >= 0.0 && p.beta2 < 1.0, "{}: expected beta2 in [0, 1) but found {}", op, p.beta2);
  MT_CHECK(std::isfinite(p.eps) && p.eps >= 0.0, "{}: expected eps >= 0 but found {}", op, p.eps);
  MT_CHECK(std::isfinite(p.weight_decay) && p.weight_decay >= 0.0, "{}: expected weight_decay >= 0 but found {}", op,
           p.weight_decay);
  MT_CHECK(p.step >= 1, "{}: expected step >= 1 (1 on the first update) but found {}", op, p.step);
  MT_CHECK(std::isfinite(p.grad_scale) && p.grad_scale > 0.0 && p.grad_scale <= 1.0,
           "{}: expected grad_scale in (0, 1] (a clip coefficient) but found {}", op, p.grad_scale);
}

// The sum over the tensors, in list order, of their sums of squares (validated by the caller). On CUDA the
// per-tensor sums come back in one copy.
double total_sum_of_squares(const Stream& stream, const std::vector<Tensor>& tensors) {
  double total = 0.0;
#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    for (double sum : cuda::sums_of_squares(stream, tensors)) total += sum;
    return total;
  }
#endif
  (void)stream;
  for (const Tensor& t : tensors) total += cpu::sum_of_squares(t);
  return total;
}

}  // namespace

void adamw_step(Stream& stream, Tensor param, Tensor exp_avg, Tensor exp_avg_sq, const Tensor& grad,
                const AdamWParams& params) {
  constexpr const char* op = "adamw_step";
  OpScope profile(stream, "optimizer", op);
  check_stream_backend(stream, op);
  check_float(param, stream, op, "param");
  check_moments(exp_avg, exp_avg_sq, param, stream, op, "");
  check_like(grad, param, stream, op, "grad");
  check_adamw_params(params, op);
#if MOETRAIN_HAS_CUDA
  if (param.device().is_cuda()) {
    cuda::adamw_step(stream, param, exp_avg, exp_avg_sq, grad, params);
    return;
  }
#endif
  cpu::adamw_step(param, exp_avg, exp_avg_sq, grad, params);
}

void adamw_step_multi(Stream& stream, const std::vector<Tensor>& params, const std::vector<Tensor>& exp_avg,
                      const std::vector<Tensor>& exp_avg_sq, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& compute_copies, const std::vector<double>& weight_decay,
                      const AdamWParams& hyper) {
  constexpr const char* op = "adamw_step_multi";
  OpScope profile(stream, "optimizer", op);
  check_stream_backend(stream, op);
  const size_t n = params.size();
  MT_CHECK(exp_avg.size() == n && exp_avg_sq.size() == n && grads.size() == n && weight_decay.size() == n,
           "{}: expected one exp_avg, exp_avg_sq, grad and weight_decay per param ({} params) but found {}, {}, {} "
           "and {}",
           op, n, exp_avg.size(), exp_avg_sq.size(), grads.size(), weight_decay.size());
  MT_CHECK(compute_copies.empty() || compute_copies.size() == n,
           "{}: expected compute_copies empty or with one entry per param ({}) but found {}", op, n,
           compute_copies.size());
  AdamWParams shared = hyper;
  shared.weight_decay = 0.0;  // replaced by weight_decay[i]; checked below
  check_adamw_params(shared, op);
  // The copies the kernels write: undefined where there is none (no list, an undefined entry, or params[i] itself).
  std::vector<Tensor> copies(n);
  std::vector<const void*> storages;
  for (size_t i = 0; i < n; ++i) {
    check_float(params[i], stream, op, fmt::format("params[{}]", i));
    check_moments(exp_avg[i], exp_avg_sq[i], params[i], stream, op, fmt::format("[{}]", i));
    // One launch on CUDA reads every moment in one dtype.
    MT_CHECK(exp_avg[i].dtype() == exp_avg[0].dtype(), "{}: expected every moment in {} (exp_avg[0]'s) but found {}",
             op, dtype_name(exp_avg[0].dtype()), exp_avg[i].describe());
    check_like(grads[i], params[i], stream, op, fmt::format("grads[{}]", i));
    MT_CHECK(std::isfinite(weight_decay[i]) && weight_decay[i] >= 0.0,
             "{}: expected weight_decay[{}] >= 0 but found {}", op, i, weight_decay[i]);
    if (params[i].numel() > 0) storages.push_back(params[i].raw_data());
    if (compute_copies.empty() || !compute_copies[i].defined()) continue;
    const Tensor& c = compute_copies[i];
    if (c.raw_data() == params[i].raw_data() && c.dtype() == params[i].dtype() && c.shape() == params[i].shape()) {
      continue;  // the param is its own compute weight
    }
    const std::string what = fmt::format("{}: compute_copies[{}]", op, i);
    expect_shape(c, params[i].shape(), what);
    expect_contiguous(c, what);
    check_on_stream_device(stream, c, op, fmt::format("compute_copies[{}]", i));
    if (stream.device().is_cuda()) {
      MT_CHECK(c.dtype() == DType::BF16 || c.dtype() == DType::F32,
               "{}: expected compute_copies[{}] in bf16 or f32 (CUDA) but found {}", op, i, c.describe());
    } else {
      MT_CHECK(c.dtype() == DType::BF16 || c.dtype() == DType::F32 || c.dtype() == DType::F64,
               "{}: expected compute_copies[{}] in bf16, f32 or f64 but found {}", op, i, c.describe());
    }
    MT_CHECK(c.numel() == 0 || c.raw_data() != params[i].raw_data(),
             "{}: compute_copies[{}] ({}) shares params[{}]'s memory ({}) but is not that tensor", op, i, c.describe(),
             i, params[i].describe());
    copies[i] = c;
  }
  // A param listed twice would be updated twice (and raced on CUDA).
  std::sort(storages.begin(), storages.end());
  MT_CHECK(std::adjacent_find(storages.begin(), storages.end()) == storages.end(),
           "{}: expected distinct params but one tensor's memory is listed twice", op);
#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    cuda::adamw_step_multi(stream, params, exp_avg, exp_avg_sq, grads, copies, weight_decay, hyper);
    return;
  }
#endif
  // The CPU reference: the per-tensor update, then the copy's cast.
  for (size_t i = 0; i < n; ++i) {
    AdamWParams p = hyper;
    p.weight_decay = weight_decay[i];
    cpu::adamw_step(params[i], exp_avg[i], exp_avg_sq[i], grads[i], p);
    if (copies[i].defined()) cpu::cast(copies[i], params[i]);
  }
}

double sum_of_squares(Stream& stream, const Tensor& x) {
  constexpr const char* op = "sum_of_squares";
  OpScope profile(stream, "optimizer", op);
  check_stream_backend(stream, op);
  check_float(x, stream, op, "x");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) return cuda::sum_of_squares(stream, x);
#endif
  return cpu::sum_of_squares(x);
}

double global_norm(Stream& stream, const std::vector<Tensor>& tensors) {
  constexpr const char* op = "global_norm";
  OpScope profile(stream, "optimizer", op);
  check_stream_backend(stream, op);
  for (size_t i = 0; i < tensors.size(); ++i) check_float(tensors[i], stream, op, fmt::format("tensors[{}]", i));
  return std::sqrt(total_sum_of_squares(stream, tensors));
}

double clip_coefficient(double norm, double max_norm) {
  MT_CHECK(!std::isnan(max_norm), "clip_coefficient: expected a max_norm (<= 0 disables clipping) but found NaN");
  if (max_norm <= 0.0 || !std::isfinite(norm)) return 1.0;
  // A coefficient of 1 leaves the values as they are, so only a real clip touches them.
  const double coefficient = max_norm / (norm + 1e-6);
  return coefficient < 1.0 ? coefficient : 1.0;
}

double clip_by_global_norm(Stream& stream, const std::vector<Tensor>& grads, double max_norm) {
  constexpr const char* op = "clip_by_global_norm";
  OpScope profile(stream, "optimizer", op);
  check_stream_backend(stream, op);
  MT_CHECK(!std::isnan(max_norm), "{}: expected a max_norm (<= 0 disables clipping) but found NaN", op);
  for (size_t i = 0; i < grads.size(); ++i) check_float(grads[i], stream, op, fmt::format("grads[{}]", i));
  const double norm = std::sqrt(total_sum_of_squares(stream, grads));
  // A non-finite norm is returned for the caller to act on (skip the step), the gradients unchanged.
  const double coefficient = clip_coefficient(norm, max_norm);
  if (coefficient == 1.0) return norm;
  for (const Tensor& g : grads) {
#if MOETRAIN_HAS_CUDA
    if (g.device().is_cuda()) {
      cuda::scale_inplace(stream, g, coefficient);
      continue;
    }
#endif
    cpu::scale_inplace(g, coefficient);
  }
  return norm;
}

}  // namespace moetrain::ops
