// defines: CUDA set-up: device, stream, pooled allocator, copies, cuBLASLt handle.
#include "ops/cuda/runtime.h"

#include "core/allocator.h"
#include "core/error.h"
#include "core/log.h"
#include "core/tensor.h"

#if MOETRAIN_HAS_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "ops/cuda/check.h"
#endif

namespace moetrain::ops::cuda {

#if MOETRAIN_HAS_CUDA

namespace {

constexpr size_t kCublasWorkspaceBytes = 64ull << 20;

struct CudaState {
  int device = -1;
  cudaStream_t stream = nullptr;
  Stream stream_token;
  cudaStream_t communication = nullptr;  // collectives that overlap compute (core/device.h)
  Stream communication_token;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;
};

CudaState& state() {
  static CudaState s;
  return s;
}

thread_local cudaStream_t t_scoped_stream = nullptr;  // StreamScope

// Where this thread's allocations, frees and copies go: a StreamScope's stream, else the compute stream.
cudaStream_t current_stream() { return t_scoped_stream != nullptr ? t_scoped_stream : state().stream; }

void* pool_allocate(size_t bytes, Device device) {
  void* data = nullptr;
  const cudaError_t status = cudaMallocAsync(&data, bytes == 0 ? 1 : bytes, current_stream());
  MT_CHECK(status == cudaSuccess, "allocation: could not allocate {} bytes on {}: {}", bytes, device.str(),
           cudaGetErrorString(status));
  return data;
}

void pool_release(void* data, size_t, Device) {
  // Stream-ordered: the memory returns to the pool after the work queued so far.
  const cudaError_t status = cudaFreeAsync(data, current_stream());
  // Tensors held by process-lifetime caches are released after the CUDA runtime has shut down at
  // exit; the driver reclaims that memory itself, and throwing from a destructor would abort.
  if (status == cudaErrorCudartUnloading) {
    cudaGetLastError();
    return;
  }
  MT_CUDA_CHECK(status);
}

void pool_memset_zero(void* data, size_t bytes, Device) {
  MT_CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, current_stream()));
}

void copy_between(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  cudaMemcpyKind kind = cudaMemcpyDeviceToDevice;
  if (dst_device.is_cpu()) kind = cudaMemcpyDeviceToHost;
  if (src_device.is_cpu()) kind = cudaMemcpyHostToDevice;
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, current_stream()));
  // A copy to the host is read right after; one from the host may be freed right after.
  if (dst_device.is_cpu() || src_device.is_cpu()) MT_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
}

// An event per wait: recorded on the signaller, waited on by the waiter, destroyed at once (CUDA frees it when it
// completes). A few per layer and micro-batch, far below the cost of the work they order.
void wait_between_streams(const Stream& waiter, const Stream& signaller) {
  cudaEvent_t event = nullptr;
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  MT_CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(signaller.native())));
  MT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter.native()), event, 0));
  MT_CUDA_CHECK(cudaEventDestroy(event));
}

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky error, report none
    return 0;
  }
  return count;
}

void setup_cuda(int index) {
  CudaState& s = state();
  if (s.device == index) {  // set up already: make it the calling thread's device (thread ranks sharing a GPU)
    MT_CUDA_CHECK(cudaSetDevice(index));
    return;
  }
  MT_CHECK(s.device < 0, "cuda: this process drives {} already and cannot set up cuda:{} as well",
           Device::cuda(s.device).str(), index);
  const int count = device_count();
  MT_CHECK(index >= 0 && index < count, "cuda: device cuda:{} requested but {} CUDA device(s) are visible", index,
           count);
  MT_CUDA_CHECK(cudaSetDevice(index));
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s.communication, cudaStreamNonBlocking));
  // Keep freed memory in the pool instead of returning it to the driver at every synchronisation.
  cudaMemPool_t pool = nullptr;
  MT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, index));
  uint64_t threshold = UINT64_MAX;
  MT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  const cublasStatus_t status = cublasLtCreate(&s.cublaslt);
  MT_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuda: cublasLtCreate failed with status {}", static_cast<int>(status));
  MT_CUDA_CHECK(cudaMalloc(&s.workspace, kCublasWorkspaceBytes));
  s.device = index;
  s.stream_token = Stream(Device::cuda(index), s.stream);
  register_device_allocator(DeviceKind::CUDA, {pool_allocate, pool_release, pool_memset_zero});
  register_copy_bytes(copy_between);
  register_default_stream(Device::cuda(index), &s.stream_token);
  s.communication_token = Stream(Device::cuda(index), s.communication);
  register_communication_stream(Device::cuda(index), &s.communication_token);
  register_stream_wait(wait_between_streams);
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  log_info("cuda: {} ({}, {} SMs, {:.0f} GiB)", Device::cuda(index).str(), prop.name, prop.multiProcessorCount,
           static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
}

bool is_setup() { return state().device >= 0; }

void* stream_handle(const Stream& stream) {
  MT_CHECK(stream.device().is_cuda() && stream.native() != nullptr, "cuda: expected a CUDA stream but found one for {}",
           stream.device().str());
  return stream.native();
}

void* cublaslt_handle() {
  MT_CHECK(is_setup(), "cuda: the backend is not set up (setup_cuda)");
  return state().cublaslt;
}

void* cublaslt_workspace(size_t* bytes) {
  MT_CHECK(is_setup(), "cuda: the backend is not set up (setup_cuda)");
  *bytes = kCublasWorkspaceBytes;
  return state().workspace;
}

DeviceMemory device_memory() {
  MT_CHECK(is_setup(), "cuda: the backend is not set up (setup_cuda)");
  size_t free_bytes = 0, total_bytes = 0;
  MT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return DeviceMemory{static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
}

int cudnn_runtime_version() { return static_cast<int>(cudnnGetVersion()); }

void synchronize(Device device) {
  if (device.is_cuda()) MT_CUDA_CHECK(cudaStreamSynchronize(state().stream));
}

StreamScope::StreamScope(const Stream& stream) {
  if (!stream.device().is_cuda()) return;
  previous_ = t_scoped_stream;
  t_scoped_stream = static_cast<cudaStream_t>(stream_handle(stream));
  active_ = true;
}

StreamScope::~StreamScope() {
  if (active_) t_scoped_stream = static_cast<cudaStream_t>(previous_);
}

#else

int device_count() { return 0; }
void setup_cuda(int index) { MT_FAIL("cuda: this build has no CUDA backend (cuda:{} requested)", index); }
bool is_setup() { return false; }
void* stream_handle(const Stream&) { MT_FAIL("cuda: this build has no CUDA backend"); }
void* cublaslt_handle() { MT_FAIL("cuda: this build has no CUDA backend"); }
void* cublaslt_workspace(size_t*) { MT_FAIL("cuda: this build has no CUDA backend"); }
DeviceMemory device_memory() { MT_FAIL("cuda: this build has no CUDA backend"); }
int cudnn_runtime_version() { return 0; }
void synchronize(Device) {}
// Nothing to redirect without CUDA; the fields stay at their defaults (and stay referenced, so that a build with
// -Wunused-private-field accepts the one class definition both builds share).
StreamScope::StreamScope(const Stream&) : previous_(nullptr), active_(false) {}
StreamScope::~StreamScope() { MT_CHECK(!active_ && previous_ == nullptr, "cuda: a StreamScope without CUDA was set"); }

#endif

}  // namespace moetrain::ops::cuda
