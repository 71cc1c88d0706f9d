// defines: AdamW over a ParameterStore's fp32 masters, with PyTorch's parameter groups: weight
// decay on matrices (dim >= 2), none on norms, biases and other 1-D tensors. One step is one
// ops::adamw_step_multi call (one kernel launch on CUDA) that also writes the bf16 compute copies. The moments are
// kept in f32 or, as an option (AdamWConfig::state_dtype), in bf16.
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
  // The moments' dtype: f32, or bf16 (half their bytes, read and written by every step; ops::adamw_step).
  DType state_dtype = DType::F32;
};

class AdamW {
 public:
  // Takes the store's compute copies (ParameterStore::weight where its dtype differs from the
  // master's, i.e. the bf16 matrices under bf16 compute): every step rewrites them from the updated
  // masters, so no refresh_compute_weights is needed after a step.
  AdamW(model::ParameterStore& store, const AdamWConfig& config);
  // Over explicit lists (ZeRO-3: this rank's shards, train/fully_sharded.h): one entry per parameter in each;
  // `compute_copies` entries undefined where there is no copy to write. Moments start at zero.
  AdamW(std::vector<Tensor> params, std::vector<Tensor> grads, std::vector<Tensor> compute_copies,
        std::vector<double> weight_decay, const AdamWConfig& config);

  // One update of every parameter from its gradient at learning rate `lr`; the compute copies
  // follow (bit for bit what refresh_compute_weights would write).
  void step(double lr);
  // The same update on the parameters i with owned[i] only (pipeline parallelism: a rank updates
  // what it owns; the others keep their values, moments and copies). owned has one entry per
  // parameter; steps_taken() advances by one as in step().
  void step(double lr, const std::vector<bool>& owned);
  // step(lr) with the gradient clip folded in: each gradient is scaled by `clip_coefficient`
  // (ops::clip_coefficient) inside the update, the same bits as ops::clip_by_global_norm scaling it
  // beforehand, without a pass of its own; the gradients stay as they are in memory.
  void step_with_clip(double lr, double clip_coefficient);

  // Replaces the copies the step writes: one entry per parameter (undefined or the master itself:
  // none), or an empty list to write none (then refresh_compute_weights is the caller's again).
  void set_compute_copies(std::vector<Tensor> copies);
  const std::vector<Tensor>& compute_copies() const { return compute_copies_; }

  int64_t steps_taken() const { return steps_; }
  // The moments, in the store's parameter order (for checkpoints), in state_dtype().
  DType state_dtype() const { return config_.state_dtype; }
  const std::vector<Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<Tensor>& exp_avg_sq() const { return exp_avg_sq_; }
  std::vector<Tensor>& exp_avg() { return exp_avg_; }
  std::vector<Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }

 private:
  void update(double lr, const std::vector<bool>& owned, double grad_scale);
  std::vector<Tensor> params_, grads_;
  AdamWConfig config_;
  int64_t steps_ = 0;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::vector<Tensor> compute_copies_;  // empty, or per parameter (undefined: none)
  std::vector<double> weight_decay_;    // per parameter: config.weight_decay on matrices, else 0
};

}  // namespace moetrain::train
