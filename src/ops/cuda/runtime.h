// defines: the CUDA backend's process-wide set-up (docs/design.md section 4: set once, read
// everywhere): for one device, a compute stream, a stream-ordered allocator (CUDA memory pools)
// registered with core's allocator registry, host<->device copies, and the cuBLASLt handle and
// workspace. A build without CUDA reports no device and refuses set-up with a clear error.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.h"

namespace moetrain::ops::cuda {

// Number of CUDA devices visible; 0 when the build has no CUDA or the machine no driver/GPU.
int device_count();
// Sets up device `index` once (later calls for the same device only make it the calling thread's current device;
// another device is an error: one process drives one GPU). Fails closed when no device is present.
void setup_cuda(int index);
bool is_setup();

// Raw handles for kernels and library wrappers (cudaStream_t / cublasLtHandle_t as void*).
void* stream_handle(const Stream& stream);
void* cublaslt_handle();
void* cublaslt_workspace(size_t* bytes);

// The set-up device's free and total memory in bytes, as the driver reports them (cudaMemGetInfo): what the memory
// fit check of a job (train/memory_fit.h) compares the planned peak against. Requires setup_cuda.
struct DeviceMemory {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
DeviceMemory device_memory();

// cudnnGetVersion() of the cuDNN library loaded at run time (not the headers'): which one runs depends on the library
// path (scripts/gpu_env.sh). 0 in a build without CUDA.
int cudnn_runtime_version();

// Blocks until the device's compute stream is idle (metrics, host reads).
void synchronize(Device device);

// While alive, this thread's device allocations, frees, zero-fills and copies go to `stream` instead of the compute
// stream: work placed on the communication stream (core/device.h) keeps its temporaries in its own stream order. A
// tensor made inside and freed outside is freed on the compute stream, so the caller makes compute wait for
// `stream` before dropping it. Nothing to do for a CPU stream or in a build without CUDA. Scopes nest.
class StreamScope {
 public:
  explicit StreamScope(const Stream& stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  void* previous_ = nullptr;
  bool active_ = false;
};

}  // namespace moetrain::ops::cuda
