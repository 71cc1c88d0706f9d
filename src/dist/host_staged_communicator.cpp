// defines: stage_through_host (dist/host_staged_communicator.h): device tensors copied to host buffers, the
// in-process op run on them with the turn let go, the results copied back with the turn held again.
#include "dist/host_staged_communicator.h"

#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moetrain::dist {

namespace {

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(std::unique_ptr<Communicator> inner, Device device, std::shared_ptr<DeviceTurn> turn)
      : inner_(std::move(inner)), device_(device), turn_(std::move(turn)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }

  void all_reduce(Stream& stream, Tensor data, ReduceOp op) override {
    Tensor host = stage({"all_reduce", *this}, stream, data, "data");
    waiting([&] { inner_->all_reduce(Stream::cpu(), host, op); });
    data.copy_from(host);
  }

  void all_gather(Stream& stream, Tensor out, const Tensor& in) override {
    const detail::OpContext ctx{"all_gather", *this};
    const Tensor host_in = stage(ctx, stream, in, "in");
    Tensor host_out = host_buffer(ctx, out, "out");
    waiting([&] { inner_->all_gather(Stream::cpu(), host_out, host_in); });
    out.copy_from(host_out);
  }

  void reduce_scatter(Stream& stream, Tensor out, const Tensor& in, ReduceOp op) override {
    const detail::OpContext ctx{"reduce_scatter", *this};
    const Tensor host_in = stage(ctx, stream, in, "in");
    Tensor host_out = host_buffer(ctx, out, "out");
    waiting([&] { inner_->reduce_scatter(Stream::cpu(), host_out, host_in, op); });
    out.copy_from(host_out);
  }

  void broadcast(Stream& stream, Tensor data, int root) override {
    Tensor host = stage({"broadcast", *this}, stream, data, "data");
    waiting([&] { inner_->broadcast(Stream::cpu(), host, root); });
    data.copy_from(host);
  }

  void send(Stream& stream, const Tensor& data, int peer) override {
    const Tensor host = stage({"send", *this}, stream, data, "data");
    waiting([&] { inner_->send(Stream::cpu(), host, peer); });
  }

  void recv(Stream& stream, Tensor data, int peer) override {
    const detail::OpContext ctx{"recv", *this};
    check_stream(ctx, stream);
    Tensor host = host_buffer(ctx, data, "data");
    if (group_depth_ > 0) {  // the inner backend receives at group_end; the bytes come back to the device then
      inner_->recv(Stream::cpu(), host, peer);
      pending_.push_back({data, host});
      return;
    }
    waiting([&] { inner_->recv(Stream::cpu(), host, peer); });
    data.copy_from(host);
  }

  void all_to_all_v(Stream& stream, Tensor out, const std::vector<int64_t>& recv_rows, const Tensor& in,
                    const std::vector<int64_t>& send_rows) override {
    const detail::OpContext ctx{"all_to_all_v", *this};
    const Tensor host_in = stage(ctx, stream, in, "in");
    Tensor host_out = host_buffer(ctx, out, "out");
    waiting([&] { inner_->all_to_all_v(Stream::cpu(), host_out, recv_rows, host_in, send_rows); });
    out.copy_from(host_out);
  }

  void barrier(Stream& stream) override {
    check_stream({"barrier", *this}, stream);
    waiting([&] { inner_->barrier(Stream::cpu()); });
  }

  void group_start() override {
    ++group_depth_;
    inner_->group_start();
  }

  void group_end() override {
    MT_CHECK(group_depth_ > 0, "dist: group_end on '{}' (rank {}) without a matching group_start", name(), rank());
    waiting([&] { inner_->group_end(); });
    if (--group_depth_ > 0) return;
    std::vector<std::pair<Tensor, Tensor>> pending = std::move(pending_);
    pending_.clear();
    for (auto& [device_tensor, host] : pending) device_tensor.copy_from(host);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    std::unique_ptr<Communicator> part;
    waiting([&] { part = inner_->split(color, key, name); });
    if (part == nullptr) return nullptr;
    return std::make_unique<HostStagedCommunicator>(std::move(part), device_, turn_);
  }

  void check_health() override { inner_->check_health(); }

 private:
  // Lets go of the turn while `wait` runs (another rank may queue its GPU work meanwhile) and takes it back after,
  // also when `wait` throws, so the rank's thread always ends holding it.
  template <typename F>
  void waiting(F&& wait) {
    turn_->unlock();
    try {
      wait();
    } catch (...) {
      turn_->lock();
      throw;
    }
    turn_->lock();
  }

  void check_stream(const detail::OpContext& ctx, const Stream& stream) const {
    MT_CHECK(stream.device() == device_,
             "dist: {} on '{}' (rank {}): the ranks share {} but the op was given a stream on {}", ctx.op, name(),
             rank(), device_.str(), stream.device().str());
  }

  // The host copy of a device tensor. The copy runs on the backend's current stream and waits for it: the op's stream,
  // or the default stream the op's stream waited for (the expert exchange and ZeRO-3 queue their collectives on the
  // communication stream after it).
  Tensor stage(const detail::OpContext& ctx, const Stream& stream, const Tensor& t, std::string_view what) const {
    check_stream(ctx, stream);
    detail::check_tensor(ctx, t, what, device_);
    return t.to(Device::cpu());
  }

  // A host buffer the shape and dtype of a device tensor an op writes.
  Tensor host_buffer(const detail::OpContext& ctx, const Tensor& t, std::string_view what) const {
    detail::check_tensor(ctx, t, what, device_);
    return Tensor::empty(t.shape(), t.dtype());
  }

  std::unique_ptr<Communicator> inner_;
  Device device_;
  std::shared_ptr<DeviceTurn> turn_;
  int group_depth_ = 0;
  std::vector<std::pair<Tensor, Tensor>> pending_;  // receives of an open group: (device tensor, its host buffer)
};

}  // namespace

std::unique_ptr<Communicator> stage_through_host(std::unique_ptr<Communicator> inner, Device device,
                                                 std::shared_ptr<DeviceTurn> turn) {
  MT_CHECK(inner != nullptr && device.is_cuda() && turn != nullptr,
           "dist: stage_through_host needs an in-process communicator, a CUDA device and a turn; found {}{}",
           device.str(), inner == nullptr ? " and no communicator" : "");
  return std::make_unique<HostStagedCommunicator>(std::move(inner), device, std::move(turn));
}

bool is_host_staged(const Communicator& comm) { return dynamic_cast<const HostStagedCommunicator*>(&comm) != nullptr; }

}  // namespace moetrain::dist
