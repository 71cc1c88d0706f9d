// defines: ShardedTensor, one parameter under ZeRO-3 / FSDP2 sharding (docs/design.md sections 1 and 3): its fp32
// master and gradient live only as this rank's 1/N shard; the full compute weight exists only between gather() and
// release(), the full gradient only between begin_grad() and reduce_grad(), which reduce-scatters it into a shard.
// The full tensors the model's blocks captured at construction stay valid handles throughout: their storage bytes
// are freed and re-allocated underneath them (core/allocator.h), so the model knows nothing of the sharding.
//
// Layout. A tensor is sharded over the flat element range [begin, end) (the whole tensor, or, for an expert bank
// under expert parallelism, the rows of this ep rank's experts) among the N ranks of `comm`: S = ceil((end - begin)
// / N) elements each, rank r holding [begin + r * S, begin + (r + 1) * S), the last shard zero-padded past `end`.
// Elements outside [begin, end) are not this group's: gathered weights hold 0 there and gradients there are dropped.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "dist/communicator.h"

namespace moetrain::dist {

struct ShardedTensorSpec {
  std::string name;  // for errors and logs
  Tensor weight;     // the full tensor compute reads: a bf16 copy of the master, or the fp32 master itself
  Tensor master;     // the full fp32 master
  Tensor grad;       // the full fp32 gradient
  int64_t begin = 0;
  int64_t end = -1;  // -1: the tensor's element count
  Communicator* comm = nullptr;
};

class ShardedTensor {
 public:
  // Takes this rank's shard of the full master and of the full weight (whose values must be identical on every rank
  // of comm), then frees the full weight, master and gradient bytes. Collective-free.
  explicit ShardedTensor(const ShardedTensorSpec& spec);

  const std::string& name() const { return name_; }
  Communicator& comm() const { return *comm_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  Tensor master_shard() const { return master_shard_; }  // f32 [S]
  Tensor grad_shard() const { return grad_shard_; }      // f32 [S]
  // The weight dtype's shard that gather() all-gathers: the bf16 copy of master_shard (the optimizer rewrites it),
  // or master_shard itself under f32 compute.
  Tensor weight_shard() const { return weight_shard_; }
  bool weight_is_master() const { return weight_is_master_; }
  bool gathered() const { return gathered_; }
  bool grad_live() const { return grad_live_; }

  // Streams. `compute` is where the model reads the weight and writes the gradient; the collectives run on `comm`
  // (the same stream, or a communication stream that overlaps compute: core/device.h), which first waits for the
  // work queued on `compute`. Before compute reads what a collective wrote, the caller makes it wait for `comm`.

  // Full weight from every rank's weight shard (all_gather on comm). Nothing to do when already gathered.
  void gather(Stream& compute, Stream& comm);
  // Frees the full weight's bytes (ordered after the compute that read it). Nothing to do when not gathered.
  void release();
  // A zeroed full gradient for the backward to accumulate into. Nothing to do when already live; refused while a
  // reduction still reads the last one (free_reduced_grad first).
  void begin_grad(Stream& compute);
  // Sums the full gradient over comm into this rank's shard, written into `out` (f32 [S]) on comm. The full
  // gradient's bytes stay until free_reduced_grad, which the caller calls once compute waited for comm (or at once
  // when comm is compute).
  void reduce_grad(Stream& compute, Stream& comm, Tensor out);
  bool grad_awaiting_free() const { return grad_awaiting_free_; }
  void free_reduced_grad();

  // This rank's shard of a full tensor shaped like the parameter (any dtype): a new [S] tensor on the parameter's
  // device, zero past `end`.
  Tensor take_shard(const Tensor& full) const;
  // The full master's storage bytes back, all-gathered from every rank's master shard (0 outside [begin, end)),
  // and freed again: whoever needs the whole model (full_parameters) reads the full masters in between.
  void materialize_master(Stream& stream);
  void release_master();

 private:
  Tensor flat(const Tensor& full) const;  // the full tensor as [numel]
  // The storage of one of the model's full tensors as [begin + N * S] elements: its bytes are allocated that long,
  // so that the collectives write and read N * S elements from `begin` in place, with no staging copy.
  Tensor padded_flat(const Tensor& full) const;
  int64_t padded_elements() const;
  void gather_in_place(Stream& compute, Stream& comm, const Tensor& full, const Tensor& shard);

  std::string name_;
  Communicator* comm_ = nullptr;
  Tensor weight_, master_, grad_;  // full handles (bytes present only while gathered / live)
  int64_t begin_ = 0, end_ = 0, shard_numel_ = 0;
  bool weight_is_master_ = false;
  bool gathered_ = false, grad_live_ = false, master_live_ = false, grad_awaiting_free_ = false;
  Tensor master_shard_, grad_shard_, weight_shard_;
};

}  // namespace moetrain::dist
