// defines: AdamW over a ParameterStore's fp32 masters, with PyTorch's parameter groups: weight
// decay on matrices (dim >= 2), none on norms, biases and other 1-D tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/parameter_store.h"

namespace moetrain::train {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

class AdamW {
 public:
  AdamW(model::ParameterStore& store, const AdamWConfig& config);

  // One update of every parameter from its gradient at learning rate `lr`.
  void step(double lr);

  int64_t steps_taken() const { return steps_; }
  // The moments, in the store's parameter order (for checkpoints).
  const std::vector<Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<Tensor>& exp_avg_sq() const { return exp_avg_sq_; }
  std::vector<Tensor>& exp_avg() { return exp_avg_; }
  std::vector<Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }

 private:
  model::ParameterStore& store_;
  AdamWConfig config_;
  int64_t steps_ = 0;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
};

}  // namespace moetrain::train
