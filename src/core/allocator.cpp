// defines: CPU allocation (64-byte aligned), the registry of device allocators and the counters.
#include "core/allocator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/error.h"

namespace moetrain {

namespace {

constexpr size_t kCpuAlignment = 64;
constexpr int kDeviceKinds = 2;

struct Counters {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
};

Counters& counters(DeviceKind kind) {
  static Counters per_kind[kDeviceKinds];
  return per_kind[static_cast<int>(kind)];
}

void count_allocation(DeviceKind kind, int64_t bytes) {
  Counters& c = counters(kind);
  const int64_t live = c.live.fetch_add(bytes) + bytes;
  int64_t peak = c.peak.load();
  while (live > peak && !c.peak.compare_exchange_weak(peak, live)) {
  }
}

// Larger requests are refused before the allocator sees them (rounding up would wrap near 2^64): 2^62 bytes is
// more than any host or device holds.
constexpr size_t kMaxAllocationBytes = size_t{1} << 62;

void* cpu_allocate(size_t bytes, Device) {
  const size_t rounded = (bytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
  void* data = std::aligned_alloc(kCpuAlignment, rounded == 0 ? kCpuAlignment : rounded);
  MT_CHECK(data != nullptr, "allocation: could not allocate {} bytes on the CPU", bytes);
  return data;
}

void cpu_release(void* data, size_t, Device) { std::free(data); }
void cpu_memset_zero(void* data, size_t bytes, Device) { std::memset(data, 0, bytes); }

std::mutex g_registry_mutex;
DeviceAllocator g_allocators[kDeviceKinds] = {
    {cpu_allocate, cpu_release, cpu_memset_zero},
    {},
};

const DeviceAllocator& allocator_for(Device device) {
  const DeviceAllocator& allocator = g_allocators[static_cast<int>(device.kind)];
  MT_CHECK(allocator.allocate != nullptr,
           "allocation: no allocator for device {}; this build or this machine has no {} backend", device.str(),
           device.is_cuda() ? "CUDA" : "CPU");
  return allocator;
}

}  // namespace

Storage::~Storage() {
  if (release != nullptr && data != nullptr) {
    release(data, bytes, device);
    counters(device.kind).live.fetch_sub(static_cast<int64_t>(bytes));
  }
}

void register_device_allocator(DeviceKind kind, const DeviceAllocator& allocator) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  MT_CHECK(kind != DeviceKind::CPU, "allocation: the CPU allocator is built in and cannot be replaced");
  MT_CHECK(g_allocators[static_cast<int>(kind)].allocate == nullptr,
           "allocation: an allocator for this device kind is already registered");
  g_allocators[static_cast<int>(kind)] = allocator;
}

bool has_device_allocator(DeviceKind kind) { return g_allocators[static_cast<int>(kind)].allocate != nullptr; }

std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device) {
  MT_CHECK(bytes <= kMaxAllocationBytes, "allocation: {} bytes on {} is more than the {} bytes any device holds", bytes,
           device.str(), kMaxAllocationBytes);
  const DeviceAllocator& allocator = allocator_for(device);
  auto storage = std::make_shared<Storage>();
  storage->data = allocator.allocate(bytes, device);
  storage->bytes = bytes;
  storage->device = device;
  storage->release = allocator.release;
  count_allocation(device.kind, static_cast<int64_t>(bytes));
  return storage;
}

void release_storage_bytes(Storage& storage) {
  MT_CHECK(storage.owner == nullptr && (storage.release != nullptr || storage.data == nullptr),
           "allocation: release_storage_bytes on {} bytes of foreign memory on {} (only allocator-made storage can "
           "be released and re-allocated)",
           storage.bytes, storage.device.str());
  if (storage.data == nullptr) return;
  storage.release(storage.data, storage.bytes, storage.device);
  counters(storage.device.kind).live.fetch_sub(static_cast<int64_t>(storage.bytes));
  storage.data = nullptr;
}

void allocate_storage_bytes(Storage& storage) {
  MT_CHECK(storage.data == nullptr && storage.owner == nullptr,
           "allocation: allocate_storage_bytes on a storage of {} bytes on {} that still holds memory", storage.bytes,
           storage.device.str());
  MT_CHECK(storage.bytes <= kMaxAllocationBytes,
           "allocation: {} bytes on {} is more than the {} bytes any device holds", storage.bytes, storage.device.str(),
           kMaxAllocationBytes);
  const DeviceAllocator& allocator = allocator_for(storage.device);
  storage.data = allocator.allocate(storage.bytes, storage.device);
  storage.release = allocator.release;
  count_allocation(storage.device.kind, static_cast<int64_t>(storage.bytes));
}

void zero_storage(void* data, size_t bytes, Device device) {
  if (bytes == 0) return;
  allocator_for(device).memset_zero(data, bytes, device);
}

MemoryStats memory_stats(DeviceKind kind) { return {counters(kind).live.load(), counters(kind).peak.load()}; }

void reset_peak_memory(DeviceKind kind) { counters(kind).peak.store(counters(kind).live.load()); }

}  // namespace moetrain
