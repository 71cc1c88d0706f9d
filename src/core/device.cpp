// defines: Device names and parsing, and the CPU stream token.
#include "core/device.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

std::string Device::str() const { return kind == DeviceKind::CPU ? std::string("cpu") : fmt::format("cuda:{}", index); }

namespace {
constexpr int kMaxDeviceIndex = 1024;
}  // namespace

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    const std::string digits = text.substr(5);
    MT_CHECK(!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos,
             "device: expected 'cpu', 'cuda' or 'cuda:N' but found '{}'", text);
    // At most 4 digits: more than any machine's GPUs, and never a number past int.
    MT_CHECK(digits.size() <= 4 && std::stoi(digits) < kMaxDeviceIndex,
             "device: '{}' names GPU {}, expected an index in [0, {})", text, digits, kMaxDeviceIndex);
    return Device::cuda(std::stoi(digits));
  }
  MT_FAIL("device: expected 'cpu', 'cuda' or 'cuda:N' but found '{}'", text);
}

namespace {
constexpr int kMaxDevices = 16;
Stream* g_device_streams[kMaxDevices] = {};
Stream* g_communication_streams[kMaxDevices] = {};
StreamWaitFn g_stream_wait = nullptr;
}  // namespace

Stream& communication_stream(Device device) {
  if (device.is_cpu()) return Stream::cpu();
  if (device.index >= 0 && device.index < kMaxDevices && g_communication_streams[device.index] != nullptr)
    return *g_communication_streams[device.index];
  return default_stream(device);
}

void register_communication_stream(Device device, Stream* stream) {
  MT_CHECK(device.is_cuda() && device.index >= 0 && device.index < kMaxDevices,
           "device: cannot register a communication stream for {}", device.str());
  g_communication_streams[device.index] = stream;
}

void stream_wait(const Stream& waiter, const Stream& signaller) {
  if (waiter.native() == signaller.native()) return;  // one queue (the CPU token included): already in order
  MT_CHECK(waiter.device() == signaller.device(), "device: a stream of {} cannot wait for a stream of {}",
           waiter.device().str(), signaller.device().str());
  MT_CHECK(g_stream_wait != nullptr, "device: no stream_wait registered for {}; the CUDA backend was not set up",
           waiter.device().str());
  g_stream_wait(waiter, signaller);
}

void register_stream_wait(StreamWaitFn fn) { g_stream_wait = fn; }

Stream& default_stream(Device device) {
  if (device.is_cpu()) return Stream::cpu();
  MT_CHECK(device.index >= 0 && device.index < kMaxDevices && g_device_streams[device.index] != nullptr,
           "device: no stream registered for {}; the CUDA backend was not set up", device.str());
  return *g_device_streams[device.index];
}

void register_default_stream(Device device, Stream* stream) {
  MT_CHECK(device.is_cuda() && device.index >= 0 && device.index < kMaxDevices,
           "device: cannot register a stream for {}", device.str());
  g_device_streams[device.index] = stream;
}

Stream& Stream::cpu() {
  static Stream stream;
  return stream;
}

}  // namespace moetrain
