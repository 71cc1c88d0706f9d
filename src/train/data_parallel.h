// defines: the data-parallel reductions of a training step: the global target count (so the loss
// is the exact token mean over every rank's micro-batches, docs/design.md section 1), the logged loss
// sums, and the gradients. Each rank holds the whole model (replicated data parallelism); every
// collective runs on the model device's stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"

namespace moetrain::train {

// The sum of `value` over the ranks of `comm`, exchanged through a one-element tensor on `device`.
int64_t all_reduce_sum(dist::Communicator& comm, Device device, int64_t value);
std::vector<double> all_reduce_sum(dist::Communicator& comm, Device device, const std::vector<double>& values);

// Sums every gradient over the ranks of `comm`, in place (one collective per tensor).
void all_reduce_gradients(dist::Communicator& comm, const std::vector<Tensor>& grads);

}  // namespace moetrain::train
