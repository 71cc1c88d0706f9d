// defines: the AdamW optimizer state and step.
#include "train/optimizer.h"

#include "ops/optim.h"

namespace moetrain::train {

AdamW::AdamW(model::ParameterStore& store, const AdamWConfig& config) : store_(store), config_(config) {
  for (const Tensor& p : store_.all_params()) {
    exp_avg_.push_back(Tensor::zeros(p.shape(), DType::F32, p.device()));
    exp_avg_sq_.push_back(Tensor::zeros(p.shape(), DType::F32, p.device()));
  }
}

void AdamW::step(double lr) {
  ++steps_;
  const std::vector<Tensor> params = store_.all_params();
  const std::vector<Tensor> grads = store_.all_grads();
  for (size_t i = 0; i < params.size(); ++i) {
    ops::AdamWParams p;
    p.lr = lr;
    p.beta1 = config_.beta1;
    p.beta2 = config_.beta2;
    p.eps = config_.eps;
    p.weight_decay = store_.specs()[i].is_matrix() ? config_.weight_decay : 0.0;
    p.step = steps_;
    ops::adamw_step(default_stream(params[i].device()), params[i], exp_avg_[i], exp_avg_sq_[i], grads[i], p);
  }
}

}  // namespace moetrain::train
