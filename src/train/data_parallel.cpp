// defines: the data-parallel reductions.
#include "train/data_parallel.h"

namespace moetrain::train {

int64_t all_reduce_sum(dist::Communicator& comm, Device device, int64_t value) {
  Tensor t = Tensor::from_vector<int64_t>({value}, {1}).to(device);
  comm.all_reduce(default_stream(device), t, dist::ReduceOp::Sum);
  const int64_t sum = t.to(Device::cpu()).to_vector<int64_t>()[0];
  comm.check_health();  // a collective its watchdog aborted leaves garbage behind: fail with its error instead
  return sum;
}

std::vector<double> all_reduce_sum(dist::Communicator& comm, Device device, const std::vector<double>& values) {
  Tensor t = Tensor::from_vector<double>(values, {static_cast<int64_t>(values.size())}).to(device);
  comm.all_reduce(default_stream(device), t, dist::ReduceOp::Sum);
  std::vector<double> sums = t.to(Device::cpu()).to_vector<double>();
  comm.check_health();
  return sums;
}

void all_reduce_gradients(dist::Communicator& comm, const std::vector<Tensor>& grads) {
  for (const Tensor& g : grads) comm.all_reduce(default_stream(g.device()), g, dist::ReduceOp::Sum);
}

}  // namespace moetrain::train
