// defines: the sharding of one parameter: shards taken at construction, all_gather of the weight, reduce_scatter of
// the gradient, and the storage bytes freed and re-allocated under the model's full tensors.
#include "dist/sharded_parameters.h"

#include <algorithm>

#include "core/error.h"

namespace moetrain::dist {

namespace {

void check_whole_storage(const Tensor& t, const std::string& name, const char* what) {
  expect_defined(t, what);
  MT_CHECK(t.is_contiguous() && t.storage_offset_bytes() == 0 && t.storage()->bytes == t.nbytes(),
           "sharding: the {} of '{}' must be a contiguous tensor over its whole storage (its bytes are freed and "
           "re-allocated); found {}",
           what, name, t.describe());
  MT_CHECK(t.storage()->owner == nullptr && t.storage()->release != nullptr,
           "sharding: the {} of '{}' ({}) is memory the allocator did not make (e.g. a mapped file); its bytes "
           "cannot be freed and re-allocated",
           what, name, t.describe());
}

}  // namespace

ShardedTensor::ShardedTensor(const ShardedTensorSpec& spec)
    : name_(spec.name), comm_(spec.comm), weight_(spec.weight), master_(spec.master), grad_(spec.grad) {
  MT_CHECK(comm_ != nullptr, "sharding: '{}' has no communicator", name_);
  check_whole_storage(weight_, name_, "compute weight");
  check_whole_storage(master_, name_, "master");
  check_whole_storage(grad_, name_, "gradient");
  MT_CHECK(master_.dtype() == DType::F32 && grad_.dtype() == DType::F32,
           "sharding: '{}' needs an f32 master and gradient; found {} and {}", name_, master_.describe(),
           grad_.describe());
  MT_CHECK(weight_.shape() == master_.shape() && grad_.shape() == master_.shape() &&
               weight_.device() == master_.device() && grad_.device() == master_.device(),
           "sharding: '{}': weight {}, master {} and gradient {} must have one shape and device", name_,
           weight_.describe(), master_.describe(), grad_.describe());
  const int64_t numel = master_.numel();
  begin_ = spec.begin;
  end_ = spec.end < 0 ? numel : spec.end;
  MT_CHECK(0 <= begin_ && begin_ < end_ && end_ <= numel,
           "sharding: '{}' shards elements [{}, {}) but it has {}; expected a non-empty range inside it", name_, begin_,
           end_, numel);
  const int64_t n = comm_->size();
  shard_numel_ = (end_ - begin_ + n - 1) / n;
  weight_is_master_ = weight_.storage() == master_.storage();

  master_shard_ = take_shard(master_);
  weight_shard_ = weight_is_master_ ? master_shard_ : take_shard(weight_);
  grad_shard_ = Tensor::zeros({shard_numel_}, DType::F32, master_.device());
  // From here on the full tensors' bytes exist only while gathered, padded to N * S elements past `begin`.
  for (const Tensor* t : {&grad_, &master_, &weight_}) {
    Storage& storage = *t->storage();
    if (storage.data != nullptr) release_storage_bytes(storage);
    storage.bytes = std::max(storage.bytes, static_cast<size_t>(padded_elements()) * dtype_size(t->dtype()));
  }
}

int64_t ShardedTensor::padded_elements() const {
  return std::max(begin_ + comm_->size() * shard_numel_, master_.numel());
}

Tensor ShardedTensor::flat(const Tensor& full) const { return full.view({-1}); }

Tensor ShardedTensor::padded_flat(const Tensor& full) const {
  const std::shared_ptr<Storage>& storage = full.storage();
  return Tensor::from_blob(storage->data, {padded_elements()}, full.dtype(), full.device(), storage);
}

Tensor ShardedTensor::take_shard(const Tensor& full) const {
  MT_CHECK(full.shape() == master_.shape(), "sharding: shard of '{}' taken from {} but the parameter is {}", name_,
           full.describe(), master_.describe());
  Tensor shard = Tensor::zeros({shard_numel_}, full.dtype(), master_.device());
  const int64_t first = begin_ + comm_->rank() * shard_numel_;
  const int64_t last = std::min(first + shard_numel_, end_);
  if (last > first) shard.slice(0, last - first).copy_from(flat(full).slice(first, last));
  return shard;
}

// Zeroes what the gather does not write (other experts' rows), on compute, then all-gathers the shards into
// [begin, begin + N * S) of the padded storage on comm.
void ShardedTensor::gather_in_place(Stream& compute, Stream& comm, const Tensor& full, const Tensor& shard) {
  allocate_storage_bytes(*full.storage());
  Tensor whole = padded_flat(full);
  const int64_t gathered_end = begin_ + comm_->size() * shard_numel_;
  if (begin_ > 0) whole.slice(0, begin_).zero_();
  if (gathered_end < whole.numel()) whole.slice(gathered_end, whole.numel()).zero_();
  stream_wait(comm, compute);
  comm_->all_gather(comm, whole.slice(begin_, gathered_end), shard);
}

void ShardedTensor::gather(Stream& compute, Stream& comm) {
  if (gathered_) return;
  if (!(weight_is_master_ && master_live_)) gather_in_place(compute, comm, weight_, weight_shard_);
  gathered_ = true;
}

void ShardedTensor::release() {
  if (!gathered_) return;
  gathered_ = false;
  if (!(weight_is_master_ && master_live_)) release_storage_bytes(*weight_.storage());
}

void ShardedTensor::begin_grad(Stream& compute) {
  (void)compute;
  if (grad_live_) return;
  MT_CHECK(!grad_awaiting_free_,
           "sharding: begin_grad of '{}' while its last reduction may still read the full gradient "
           "(free_reduced_grad after compute waited for the communication stream)",
           name_);
  allocate_storage_bytes(*grad_.storage());
  padded_flat(grad_).zero_();  // the padding past the tensor too: the reduction reads it
  grad_live_ = true;
}

void ShardedTensor::reduce_grad(Stream& compute, Stream& comm, Tensor out) {
  MT_CHECK(grad_live_, "sharding: reduce_grad of '{}' whose full gradient is not live (begin_grad first)", name_);
  expect_shape(out, {shard_numel_}, "sharding: reduced gradient shard");
  expect_dtype(out, DType::F32, "sharding: reduced gradient shard");
  const int64_t gathered_end = begin_ + comm_->size() * shard_numel_;
  // Past `end` the reduction would read other experts' gradients (zero on this rank in training, but not this
  // group's): cleared, so that the last shard's padding stays exactly zero.
  if (gathered_end > end_) padded_flat(grad_).slice(end_, gathered_end).zero_();
  stream_wait(comm, compute);
  comm_->reduce_scatter(comm, out, padded_flat(grad_).slice(begin_, gathered_end), ReduceOp::Sum);
  grad_live_ = false;
  grad_awaiting_free_ = true;
  if (comm.native() == compute.native()) free_reduced_grad();  // one queue: the free is ordered after it
}

void ShardedTensor::free_reduced_grad() {
  if (!grad_awaiting_free_) return;
  release_storage_bytes(*grad_.storage());
  grad_awaiting_free_ = false;
}

void ShardedTensor::materialize_master(Stream& stream) {
  if (master_live_) return;
  if (!(weight_is_master_ && gathered_)) gather_in_place(stream, stream, master_, master_shard_);
  master_live_ = true;
}

void ShardedTensor::release_master() {
  if (!master_live_) return;
  master_live_ = false;
  if (!(weight_is_master_ && gathered_)) release_storage_bytes(*master_.storage());
}

}  // namespace moetrain::dist
