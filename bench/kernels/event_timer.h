// defines: seconds_per_call, the kernel benchmarks' timer: the mean seconds a call of f takes on a CUDA stream, by
// events around `iterations` calls after `warmup` untimed ones.
#pragma once

#include <cuda_runtime.h>

#include "ops/cuda/check.h"

namespace moetrain::bench {

template <typename F>
double seconds_per_call(cudaStream_t stream, int warmup, int iterations, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t start, stop;
  MT_CUDA_CHECK(cudaEventCreate(&start));
  MT_CUDA_CHECK(cudaEventCreate(&stop));
  MT_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iterations; ++i) f();
  MT_CUDA_CHECK(cudaEventRecord(stop, stream));
  MT_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  MT_CUDA_CHECK(cudaEventDestroy(start));
  MT_CUDA_CHECK(cudaEventDestroy(stop));
  return double(ms) * 1e-3 / iterations;
}

}  // namespace moetrain::bench
