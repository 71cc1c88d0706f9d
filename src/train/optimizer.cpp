// defines: the AdamW optimizer state and step: the per-parameter lists (moments, weight decays,
// compute copies) built once, and one ops::adamw_step_multi call per step.
#include "train/optimizer.h"

#include <utility>

#include "core/error.h"
#include "ops/optim.h"

namespace moetrain::train {

namespace {

// Zero moments for `param` in the configured dtype (validated here: f32 or bf16).
Tensor zero_moment(const Tensor& param, const AdamWConfig& config) {
  MT_CHECK(config.state_dtype == DType::F32 || config.state_dtype == DType::BF16,
           "AdamW: expected the moments' dtype f32 or bf16 but found {}", dtype_name(config.state_dtype));
  return Tensor::zeros(param.shape(), config.state_dtype, param.device());
}

}  // namespace

AdamW::AdamW(model::ParameterStore& store, const AdamWConfig& config)
    : params_(store.all_params()), grads_(store.all_grads()), config_(config) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    exp_avg_.push_back(zero_moment(p, config_));
    exp_avg_sq_.push_back(zero_moment(p, config_));
    weight_decay_.push_back(store.specs()[i].is_matrix() ? config_.weight_decay : 0.0);
    const Tensor weight = store.weight(store.specs()[i].name);
    compute_copies_.push_back(weight.dtype() != p.dtype() ? weight : Tensor());
  }
}

AdamW::AdamW(std::vector<Tensor> params, std::vector<Tensor> grads, std::vector<Tensor> compute_copies,
             std::vector<double> weight_decay, const AdamWConfig& config)
    : params_(std::move(params)),
      grads_(std::move(grads)),
      config_(config),
      compute_copies_(std::move(compute_copies)),
      weight_decay_(std::move(weight_decay)) {
  MT_CHECK(grads_.size() == params_.size() && compute_copies_.size() == params_.size() &&
               weight_decay_.size() == params_.size(),
           "AdamW: expected one gradient, compute copy and weight decay per parameter ({}) but found {}, {} and {}",
           params_.size(), grads_.size(), compute_copies_.size(), weight_decay_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    MT_CHECK(grads_[i].shape() == p.shape(), "AdamW: parameter {} is {} but its gradient is {}", i, p.describe(),
             grads_[i].describe());
    exp_avg_.push_back(zero_moment(p, config_));
    exp_avg_sq_.push_back(zero_moment(p, config_));
  }
}

void AdamW::set_compute_copies(std::vector<Tensor> copies) {
  MT_CHECK(copies.empty() || copies.size() == weight_decay_.size(),
           "AdamW: expected compute copies empty or one per parameter ({}) but found {}", weight_decay_.size(),
           copies.size());
  compute_copies_ = std::move(copies);
}

void AdamW::step(double lr) { update(lr, std::vector<bool>(weight_decay_.size(), true), 1.0); }

void AdamW::step(double lr, const std::vector<bool>& owned) { update(lr, owned, 1.0); }

void AdamW::step_with_clip(double lr, double clip_coefficient) {
  update(lr, std::vector<bool>(weight_decay_.size(), true), clip_coefficient);
}

void AdamW::update(double lr, const std::vector<bool>& owned, double grad_scale) {
  MT_CHECK(owned.size() == weight_decay_.size(), "AdamW: expected one owned flag per parameter ({}) but found {}",
           weight_decay_.size(), owned.size());
  ++steps_;
  const std::vector<Tensor>& all_params = params_;
  const std::vector<Tensor>& all_grads = grads_;
  std::vector<Tensor> params, m, v, grads, copies;
  std::vector<double> decay;
  for (size_t i = 0; i < all_params.size(); ++i) {
    if (!owned[i]) continue;
    params.push_back(all_params[i]);
    m.push_back(exp_avg_[i]);
    v.push_back(exp_avg_sq_[i]);
    grads.push_back(all_grads[i]);
    decay.push_back(weight_decay_[i]);
    if (!compute_copies_.empty()) copies.push_back(compute_copies_[i]);
  }
  if (params.empty()) return;
  ops::AdamWParams p;
  p.lr = lr;
  p.beta1 = config_.beta1;
  p.beta2 = config_.beta2;
  p.eps = config_.eps;
  p.weight_decay = 0.0;  // per parameter: `decay`
  p.step = steps_;
  p.grad_scale = grad_scale;
  ops::adamw_step_multi(default_stream(params[0].device()), params, m, v, grads, copies, decay, p);
}

}  // namespace moetrain::train
