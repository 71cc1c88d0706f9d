// defines: the CPU AdamW update and sum of squares. The AdamW element math follows PyTorch's kernels step by step
// (each step rounded to T, as fp32 tensors are on the GPU), so an fp32 run tracks torch.optim.AdamW closely. The
// moments may be kept in bf16 under f32 params: read widened, updated in f32, rounded to nearest even when stored.
#include "ops/cpu/optim.h"

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

// at::lerp: start + w * (end - start) when |w| < 0.5, else end - (end - start) * (1 - w).
template <typename T>
T lerp(T start, T end, T weight) {
  const T diff = end - start;
  return std::abs(weight) < T(0.5) ? start + weight * diff : end - diff * (T(1) - weight);
}

}  // namespace

namespace {

// The moments as the update reads them: in the param's dtype T, or bf16 widened to f32 (T = f32 only).
template <typename T>
struct Moments {
  T* same = nullptr;         // the moment in T
  uint16_t* bf16 = nullptr;  // or its bf16 bits
  explicit Moments(const Tensor& t) {
    if (t.dtype() == DType::BF16) {
      bf16 = static_cast<uint16_t*>(t.raw_data());
    } else {
      same = t.data<T>();
    }
  }
  T load(int64_t i) const { return same != nullptr ? same[i] : static_cast<T>(bf16_bits_to_f32(bf16[i])); }
  // bf16 storage rounds the f32 value to nearest even (core/dtype.h), as ops::cast does.
  void store(int64_t i, T value) const {
    if (same != nullptr) {
      same[i] = value;
    } else {
      bf16[i] = f32_to_bf16_bits(static_cast<float>(value));
    }
  }
};

}  // namespace

void adamw_step(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                const AdamWParams& params) {
  // Python-side scalars of torch.optim.adamw, in double.
  const double step = static_cast<double>(params.step);
  const double decay = 1.0 - params.lr * params.weight_decay;
  const double bias_correction1 = 1.0 - std::pow(params.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(params.beta2, step);
  const double step_size = params.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);

  dispatch_float(param.dtype(), "adamw_step", [&]<typename T>() {
    T* p = param.data<T>();
    const Moments<T> m(exp_avg), v(exp_avg_sq);
    const T* g = grad.data<T>();
    const T t_decay = static_cast<T>(decay);
    const T t_one_minus_beta1 = static_cast<T>(1.0 - params.beta1);
    const T t_beta2 = static_cast<T>(params.beta2);
    const T t_one_minus_beta2 = static_cast<T>(1.0 - params.beta2);
    const T t_neg_step_size = static_cast<T>(-step_size);
    const T t_bc2_sqrt = static_cast<T>(bias_correction2_sqrt);
    const T t_eps = static_cast<T>(params.eps);
    const bool apply_decay = params.weight_decay != 0.0;
    const T t_grad_scale = static_cast<T>(params.grad_scale);  // the clip, as cpu::scale_inplace rounds it
    const bool scale_grad = params.grad_scale != 1.0;
    const int64_t n = param.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T grad = scale_grad ? g[i] * t_grad_scale : g[i];  // grad.mul_(clip_coef)
      if (apply_decay) p[i] = p[i] * t_decay;                  // param.mul_(1 - lr * wd)
      const T avg = lerp(m.load(i), grad, t_one_minus_beta1);  // exp_avg.lerp_(grad, 1 - b1)
      T avg_sq = v.load(i) * t_beta2;                          // exp_avg_sq.mul_(b2)
      avg_sq = avg_sq + t_one_minus_beta2 * (grad * grad);     // .addcmul_(grad, grad, 1 - b2)
      const T denom = std::sqrt(avg_sq) / t_bc2_sqrt + t_eps;  // (sqrt(v) / bc2_sqrt).add_(eps)
      p[i] = p[i] + t_neg_step_size * (avg / denom);           // param.addcdiv_(m, denom, -ss)
      // Moments kept in bf16 are rounded as they are stored; this step's update used them unrounded.
      m.store(i, avg);
      v.store(i, avg_sq);
    }
  });
}

double sum_of_squares(const Tensor& x) {
  double sum = 0.0;
  dispatch_float(x.dtype(), "sum_of_squares", [&]<typename T>() {
    const T* px = x.data<T>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
      const double value = static_cast<double>(px[i]);
      sum += value * value;
    }
  });
  return sum;
}

}  // namespace moetrain::ops::cpu
