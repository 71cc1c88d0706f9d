// defines: the profiling events' pool.
#include "ops/cuda/profile_events.h"

#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

std::mutex g_mutex;
std::vector<cudaEvent_t> g_free;

cudaEvent_t take_event() {
  {
    std::lock_guard lock(g_mutex);
    if (!g_free.empty()) {
      cudaEvent_t event = g_free.back();
      g_free.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  MT_CUDA_CHECK(cudaEventCreate(&event));
  return event;
}

}  // namespace

void* record_profile_event(const Stream& stream) {
  cudaEvent_t event = take_event();
  MT_CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(stream_handle(stream))));
  return event;
}

double profile_event_seconds(void* start, void* stop) {
  auto a = static_cast<cudaEvent_t>(start), b = static_cast<cudaEvent_t>(stop);
  MT_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.0f;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  std::lock_guard lock(g_mutex);
  g_free.push_back(a);
  g_free.push_back(b);
  return static_cast<double>(ms) * 1e-3;
}

}  // namespace moetrain::ops::cuda
#endif
