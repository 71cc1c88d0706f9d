// defines: the ZeRO-3 parts of a model (embedding, each decoder layer, head), their gather / release / gradient
// reduction around the executor's steps, and the norm, clip and checkpoint views over the shards.
#include "train/fully_sharded.h"

#include <cmath>
#include <string>

#include "core/error.h"
#include "dist/mesh.h"
#include "ops/elementwise.h"
#include "ops/optim.h"
#include "train/data_parallel.h"

namespace moetrain::train {

FullyShardedModel::FullyShardedModel(model::CausalLm& model, dist::Mesh& mesh)
    : model_(model),
      mesh_(mesh),
      compute_(default_stream(model.device())),
      communication_(communication_stream(model.device())),
      layers_(model.layers().size()) {
  MT_CHECK(mesh.pp().size() == 1 && mesh.shape().cp == 1,
           "sharding: ZeRO-3 runs with pp = 1 and cp = 1; the mesh is {}", mesh.shape().str());
  model::ParameterStore& store = model.params();
  const auto& specs = store.specs();
  const int ep = mesh.ep().size();
  const int64_t experts = model.config().num_experts;
  tied_embedding_ = store.find_role(model::ParamRole::Head) == nullptr;
  tensors_.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const model::ParamSpec& spec = specs[i];
    dist::ShardedTensorSpec s;
    s.name = spec.name;
    s.weight = store.weight(spec.name);
    s.master = store.param(spec.name);
    s.grad = store.grad(spec.name);
    s.comm = &mesh.dp_ep();
    if (spec.role == model::ParamRole::ExpertBank && ep > 1) {
      // This ep rank's experts: rows [rank * E / ep, (rank + 1) * E / ep) of the [E, ...] bank, sharded over dp.
      MT_CHECK(spec.shape.at(0) == experts, "sharding: expert bank '{}' is {} but has not {} experts along dim 0",
               spec.name, shape_str(spec.shape), experts);
      const int64_t per_expert = shape_numel(spec.shape) / experts;
      const int64_t local = experts / ep;
      s.begin = mesh.ep().rank() * local * per_expert;
      s.end = s.begin + local * per_expert;
      s.comm = &mesh.dp();
    }
    split_over_ep_.push_back(s.comm == &mesh.dp());
    tensors_.emplace_back(s);
    if (spec.layer >= 0) {
      layers_.at(static_cast<size_t>(spec.layer)).push_back(i);
    } else if (spec.role == model::ParamRole::Embedding) {
      embedding_.push_back(i);
    } else {
      head_.push_back(i);
    }
  }
  reduced_this_step_.assign(tensors_.size(), false);
}

std::vector<size_t>& FullyShardedModel::members(const pipeline::ModelPart& part) {
  switch (part.kind) {
    case pipeline::ModelPart::Kind::Embedding: return embedding_;
    case pipeline::ModelPart::Kind::Head: return head_;
    case pipeline::ModelPart::Kind::Layer: break;
  }
  MT_CHECK(part.layer >= 0 && part.layer < static_cast<int64_t>(layers_.size()),
           "sharding: hook for decoder layer {} but the model has {}", part.layer, layers_.size());
  return layers_[static_cast<size_t>(part.layer)];
}

void FullyShardedModel::gather(const pipeline::ModelPart& part) {
  for (size_t i : members(part)) tensors_[i].gather(compute_, communication_);
  // A tied head reads the embedding's weight: gathered with the embedding, kept until its backward.
  if (part.kind == pipeline::ModelPart::Kind::Head && tied_embedding_) {
    for (size_t i : embedding_) tensors_[i].gather(compute_, communication_);
  }
}

void FullyShardedModel::wait_for_communication() {
  stream_wait(compute_, communication_);
  for (dist::ShardedTensor& t : tensors_) t.free_reduced_grad();
  in_flight_.clear();
}

void FullyShardedModel::release(const pipeline::ModelPart& part) {
  for (size_t i : members(part)) tensors_[i].release();
}

bool FullyShardedModel::next_part(const pipeline::ModelPart& part, bool forward, pipeline::ModelPart* next) const {
  using Kind = pipeline::ModelPart::Kind;
  const int64_t layers = static_cast<int64_t>(layers_.size());
  if (forward) {
    if (part.kind == Kind::Embedding)
      *next = layers > 0 ? pipeline::ModelPart::decoder_layer(0) : pipeline::ModelPart::head();
    if (part.kind == Kind::Layer)
      *next =
          part.layer + 1 < layers ? pipeline::ModelPart::decoder_layer(part.layer + 1) : pipeline::ModelPart::head();
    return part.kind != Kind::Head;
  }
  if (part.kind == Kind::Head && layers > 0) {
    *next = pipeline::ModelPart::decoder_layer(layers - 1);
    return true;
  }
  if (part.kind == Kind::Layer && part.layer > 0) {
    *next = pipeline::ModelPart::decoder_layer(part.layer - 1);
    return true;
  }
  return false;  // the embedding's backward reads no weight (a tied one is still gathered from the forward)
}

void FullyShardedModel::before_forward(const pipeline::ModelPart& part) {
  gather(part);
  wait_for_communication();
  pipeline::ModelPart next;
  if (next_part(part, true, &next)) gather(next);  // overlaps this part's compute
}

void FullyShardedModel::after_forward(const pipeline::ModelPart& part) {
  if (part.kind == pipeline::ModelPart::Kind::Embedding && tied_embedding_) return;  // the head reads it next
  release(part);
  if (part.kind == pipeline::ModelPart::Kind::Head && tied_embedding_) {  // a forward alone (no backward follows)
    for (size_t i : embedding_) tensors_[i].release();
  }
}

void FullyShardedModel::before_backward(const pipeline::ModelPart& part) {
  // The embedding's backward only scatters into its gradient: its weight is gathered again only when tied.
  if (part.kind != pipeline::ModelPart::Kind::Embedding) gather(part);
  wait_for_communication();
  for (size_t i : members(part)) tensors_[i].begin_grad(compute_);
  if (part.kind == pipeline::ModelPart::Kind::Head && tied_embedding_) {
    for (size_t i : embedding_) tensors_[i].begin_grad(compute_);
  }
  pipeline::ModelPart next;
  if (next_part(part, false, &next)) gather(next);
}

void FullyShardedModel::after_backward(const pipeline::ModelPart& part) {
  const bool last = micro_batch_ + 1 >= micro_batches_;
  if (part.kind == pipeline::ModelPart::Kind::Embedding) ++micro_batch_;  // the last part of a micro-batch's backward
  if (!reduce_every_micro_batch_ && !last) {  // the full gradients keep accumulating until the last micro-batch
    release(part);
    return;
  }
  for (size_t i : members(part)) {
    dist::ShardedTensor& t = tensors_[i];
    if (!reduced_this_step_[i]) {
      t.reduce_grad(compute_, communication_, t.grad_shard());  // the step's first micro-batch: written
      reduced_this_step_[i] = true;
    } else {
      Tensor reduced = Tensor::empty({t.shard_numel()}, DType::F32, model_.device());
      t.reduce_grad(compute_, communication_, reduced);
      ops::accumulate(communication_, t.grad_shard(), reduced);  // in order after the reduction, off compute
      in_flight_.push_back(reduced);
    }
  }
  release(part);
}

void FullyShardedModel::finish_step() { wait_for_communication(); }

void FullyShardedModel::begin_step(int64_t micro_batches, bool reduce_every_micro_batch) {
  MT_CHECK(micro_batches >= 1, "sharding: a step of {} micro-batches", micro_batches);
  micro_batches_ = micro_batches;
  micro_batch_ = 0;
  reduce_every_micro_batch_ = reduce_every_micro_batch;
  zero_grad_shards();
}

void FullyShardedModel::zero_grad_shards() {
  for (dist::ShardedTensor& t : tensors_) {
    Tensor shard = t.grad_shard();
    shard.zero_();
  }
  reduced_this_step_.assign(tensors_.size(), false);
}

std::vector<Tensor> FullyShardedModel::master_shards() const {
  std::vector<Tensor> out;
  for (const dist::ShardedTensor& t : tensors_) out.push_back(t.master_shard());
  return out;
}

std::vector<Tensor> FullyShardedModel::grad_shards() const {
  std::vector<Tensor> out;
  for (const dist::ShardedTensor& t : tensors_) out.push_back(t.grad_shard());
  return out;
}

std::vector<Tensor> FullyShardedModel::compute_shards() const {
  std::vector<Tensor> out;
  for (const dist::ShardedTensor& t : tensors_) out.push_back(t.weight_is_master() ? Tensor() : t.weight_shard());
  return out;
}

std::vector<double> FullyShardedModel::weight_decays(double weight_decay) const {
  std::vector<double> out;
  for (const model::ParamSpec& spec : model_.params().specs()) out.push_back(spec.is_matrix() ? weight_decay : 0.0);
  return out;
}

double FullyShardedModel::clip_gradients(double max_norm) {
  MT_CHECK(!std::isnan(max_norm), "trainer: optim.clip_grad_norm is NaN (<= 0 disables clipping)");
  Stream& stream = default_stream(model_.device());
  double local = 0.0;
  for (const dist::ShardedTensor& t : tensors_) local += ops::sum_of_squares(stream, t.grad_shard());
  // Non-expert shards partition each tensor over dp x ep, expert shards each ep rank's experts over dp: with
  // pp = 1 every element sits in exactly one rank's shard, so the world sum counts it once.
  const double total = all_reduce_sum(mesh_.dp_ep(), model_.device(), std::vector<double>{local})[0];
  const double norm = std::sqrt(total);
  if (max_norm <= 0.0) return norm;
  const double coefficient = max_norm / (norm + 1e-6);  // as torch.nn.utils.clip_grad_norm_
  if (!std::isfinite(norm) || !(coefficient < 1.0)) return norm;
  for (dist::ShardedTensor& t : tensors_) ops::scale_inplace(stream, t.grad_shard(), coefficient);
  return norm;
}

void FullyShardedModel::with_full_masters(const std::function<void()>& fn) {
  Stream& stream = default_stream(model_.device());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    tensors_[i].materialize_master(stream);
    if (split_over_ep_[i])  // each ep rank assembled its own experts and zeros elsewhere: the sum is the bank
      mesh_.ep().all_reduce(stream, model_.params().param(tensors_[i].name()), dist::ReduceOp::Sum);
  }
  try {
    fn();
  } catch (...) {
    for (dist::ShardedTensor& t : tensors_) t.release_master();
    throw;
  }
  for (dist::ShardedTensor& t : tensors_) t.release_master();
}

int64_t FullyShardedModel::shard_bytes() const {
  int64_t bytes = 0;
  for (const dist::ShardedTensor& t : tensors_) {
    bytes += static_cast<int64_t>(t.master_shard().nbytes() + t.grad_shard().nbytes());
    if (!t.weight_is_master()) bytes += static_cast<int64_t>(t.weight_shard().nbytes());
  }
  return bytes;
}

}  // namespace moetrain::train
