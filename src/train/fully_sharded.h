// defines: FullyShardedModel, sharded data parallelism with ZeRO-3 / FSDP2 semantics (docs/design.md section 3) over a
// model whose every rank held the same full values at start: parameters, gradients and AdamW state live as 1/N
// shards (dist/sharded_parameters.h); an executor's hooks gather a part's weights just before it runs and free them
// after, and reduce-scatter its gradients (fp32, summed) after each micro-batch's backward of that part. Non-expert
// tensors shard over dp x ep; the expert banks shard this ep rank's experts over dp (the other experts' rows are not
// this rank's: they hold zeros when gathered). The optimizer steps the shards (train/optimizer.h over shard lists).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/sharded_parameters.h"
#include "model/causal_lm.h"
#include "pipeline/parameter_hooks.h"

namespace moetrain::dist {
class Mesh;
}

namespace moetrain::train {

class FullyShardedModel final : public pipeline::ParameterHooks {
 public:
  // Shards every parameter of `model` over `mesh` (pp = 1, cp = 1) from its current values, then frees the full
  // masters, weights and gradients. The model must outlive this object.
  FullyShardedModel(model::CausalLm& model, dist::Mesh& mesh);

  // The hooks gather a part on the communication stream (core/device.h) and make compute wait for it just before
  // the part runs; meanwhile the next part's gather is already queued there (prefetch: the next layer in a forward,
  // the previous one in a backward), and each part's gradient reduction runs there after its backward.
  void before_forward(const pipeline::ModelPart& part) override;
  void after_forward(const pipeline::ModelPart& part) override;
  void before_backward(const pipeline::ModelPart& part) override;
  void after_backward(const pipeline::ModelPart& part) override;

  // At the start of a step of `micro_batches` micro-batches: zeroes the gradient shards (the next reduction of each
  // parameter overwrites rather than adds). With `reduce_every_micro_batch` each part's gradient is reduce-scattered
  // after every micro-batch's backward (ZeRO-3 memory: one part's full gradient at a time); without, the full
  // gradients accumulate over the step and each part is reduce-scattered once, after the last micro-batch's
  // backward (a fraction of the communication, the full gradients' memory; FSDP2's no-sync accumulation).
  void begin_step(int64_t micro_batches, bool reduce_every_micro_batch);
  void zero_grad_shards();
  // After the executor's step: compute waits for the last reductions, so the gradient shards can be read (clip,
  // optimizer), and the full gradients they read are freed.
  void finish_step();
  // Shards in the store's parameter order.
  const std::vector<dist::ShardedTensor>& tensors() const { return tensors_; }
  const model::CausalLm& model() const { return model_; }
  std::vector<Tensor> master_shards() const;
  std::vector<Tensor> grad_shards() const;
  // The bf16 compute shards the optimizer rewrites (undefined entries where the weight is the master itself).
  std::vector<Tensor> compute_shards() const;
  std::vector<double> weight_decays(double weight_decay) const;  // matrices decay, 1-D tensors do not

  // The global gradient norm over every shard (each element counted once across the mesh), clipped to `max_norm`
  // as ops::clip_by_global_norm does (<= 0: no clipping). Returns the norm before clipping.
  double clip_gradients(double max_norm);
  // Collective: the full masters are back in the model's store while `fn` runs (full_parameters, tests); then their
  // bytes are freed again. Checkpoints never assemble: each rank saves its own shards (sharded_checkpoint.h).
  void with_full_masters(const std::function<void()>& fn);

  // Bytes of this rank's shards (masters, gradients, compute copies; the moments are the optimizer's).
  int64_t shard_bytes() const;

 private:
  std::vector<size_t>& members(const pipeline::ModelPart& part);
  // Queues the part's gathers on the communication stream (nothing for those already gathered).
  void gather(const pipeline::ModelPart& part);
  // Makes compute wait for everything queued on the communication stream, then frees what it was reading.
  void wait_for_communication();
  void release(const pipeline::ModelPart& part);
  // The part that runs after `part` in a forward (forward = true) or a backward; false when there is none to fetch.
  bool next_part(const pipeline::ModelPart& part, bool forward, pipeline::ModelPart* next) const;

  model::CausalLm& model_;
  dist::Mesh& mesh_;
  Stream& compute_;
  Stream& communication_;
  std::vector<Tensor> in_flight_;  // reduction buffers the communication stream may still read
  std::vector<dist::ShardedTensor> tensors_;
  std::vector<bool> split_over_ep_;      // per tensor: an expert bank whose experts are spread over the ep ranks
  std::vector<bool> reduced_this_step_;  // per tensor: a gradient was reduced since zero_grad_shards
  int64_t micro_batches_ = 1, micro_batch_ = 0;  // of the step; the one whose backward runs
  bool reduce_every_micro_batch_ = true;
  std::vector<size_t> embedding_, head_;
  std::vector<std::vector<size_t>> layers_;
  bool tied_embedding_ = false;  // the head reads the embedding: it stays gathered from embed to embed backward
};

}  // namespace moetrain::train
