// defines: the allocation of tensor bytes per device, and the byte counters (live and peak) that
// metrics report. The CPU allocator lives here; a backend registers its own for its device kind
// once at start-up (setup_* in docs/design.md section 4), so core never includes CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/device.h"

namespace moetrain {

struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device;
  // Keeps foreign memory (a mapped file, a pooled block) alive; empty for memory we allocated.
  std::shared_ptr<void> owner;
  void (*release)(void* data, size_t bytes, Device device) = nullptr;

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage();
};

struct DeviceAllocator {
  void* (*allocate)(size_t bytes, Device device) = nullptr;
  void (*release)(void* data, size_t bytes, Device device) = nullptr;
  void (*memset_zero)(void* data, size_t bytes, Device device) = nullptr;
};

// Registers the allocator of one device kind. Called once by a backend's setup; re-registration is
// an error.
void register_device_allocator(DeviceKind kind, const DeviceAllocator& allocator);
bool has_device_allocator(DeviceKind kind);

std::shared_ptr<Storage> allocate_storage(size_t bytes, Device device);
// Storage whose bytes come and go while the tensors on it stay (ZeRO-3's full parameters and gradients exist only
// around the layer that uses them: dist/sharded_parameters.h). release_storage_bytes frees the bytes of a storage
// this allocator made and leaves it empty (a tensor on it then fails on data access); allocate_storage_bytes gives
// an empty storage fresh, uninitialised bytes of its size again. Both refuse foreign memory (from_blob).
void release_storage_bytes(Storage& storage);
void allocate_storage_bytes(Storage& storage);
void zero_storage(void* data, size_t bytes, Device device);

struct MemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
MemoryStats memory_stats(DeviceKind kind);
void reset_peak_memory(DeviceKind kind);

}  // namespace moetrain
