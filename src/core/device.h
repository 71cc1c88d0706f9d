// defines: Device (where a tensor's bytes live) and Stream (the ordered queue an op runs on).
// On the CPU a stream is a token that keeps op signatures identical across backends; on CUDA it
// wraps a cudaStream_t owned elsewhere (src/ops/cuda).
#pragma once

#include <atomic>
#include <string>

namespace moetrain {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static Device cpu() { return {DeviceKind::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::CUDA, index}; }
  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool is_cuda() const { return kind == DeviceKind::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Parses "cpu", "cuda", "cuda:N"; anything else is an error naming what was given.
Device parse_device(const std::string& text);

// How the ops run on a stream pick among their kernels (docs/exact_lanes.md).
//   Fastest: what is fastest for the shapes at hand (cuDNN, cuBLASLt's heuristic, paths chosen by pointer alignment or
//     by the longest document). Deterministic for given shapes, but a row's bytes may change with the number of rows.
//   BatchInvariant (exact mode): a variant chosen by the reduced dimensions alone, whose results for a row (a token)
//     do not depend on the number of rows, on the row's position or on its neighbours; an op that has no such variant
//     for its arguments refuses them. The CPU's kernels are all of this kind, so the CPU ignores the policy.
enum class KernelPolicy : uint8_t { Fastest, BatchInvariant };

class Stream {
 public:
  Stream() = default;
  Stream(Device device, void* native) : device_(device), native_(native) {}
  Stream(const Stream& other) : device_(other.device_), native_(other.native_), holders_(other.holders_.load()) {}
  Stream& operator=(const Stream& other) {
    device_ = other.device_;
    native_ = other.native_;
    holders_ = other.holders_.load();
    return *this;
  }
  static Stream& cpu();  // the process-wide CPU stream token

  Device device() const { return device_; }
  void* native() const { return native_; }  // cudaStream_t on CUDA, nullptr on the CPU
  KernelPolicy policy() const { return holders_.load() > 0 ? KernelPolicy::BatchInvariant : KernelPolicy::Fastest; }
  // The policy is BatchInvariant while anyone holds it: each exact model holds it on its device's stream while it is
  // exact (model::CausalLm::set_exact), so thread ranks sharing a device keep it until the last of them lets go.
  void hold_batch_invariant() { ++holders_; }
  void release_batch_invariant() { --holders_; }

 private:
  Device device_ = Device::cpu();
  void* native_ = nullptr;
  std::atomic<int> holders_{0};
};

// True when `stream` runs the exact lanes' batch-invariant kernels.
inline bool batch_invariant(const Stream& stream) { return stream.policy() == KernelPolicy::BatchInvariant; }

// The stream blocks run their ops on for `device`: the CPU token, or the compute stream a backend
// registered for its device at setup.
Stream& default_stream(Device device);
void register_default_stream(Device device, Stream* stream);

// The communication stream of `device`: a second queue for collectives that should overlap compute (ZeRO-3's
// gathers and gradient reductions). The CPU token on the CPU, and the default stream when the backend registered
// none. Work on it is ordered against the default stream only through stream_wait.
Stream& communication_stream(Device device);
void register_communication_stream(Device device, Stream* stream);
// Orders `waiter` after all the work queued on `signaller` so far (CUDA: an event recorded on one and waited on by
// the other, without blocking the host). Nothing to do on the CPU, whose ops run in call order, or when both are
// the same stream.
void stream_wait(const Stream& waiter, const Stream& signaller);
using StreamWaitFn = void (*)(const Stream& waiter, const Stream& signaller);
void register_stream_wait(StreamWaitFn fn);

}  // namespace moetrain
