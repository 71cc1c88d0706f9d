// defines: MT_CUDA_CHECK, the checking macro every CUDA runtime call goes through, and
// MT_CUDA_CHECK_LAUNCH for the last error after a kernel launch (cuBLAS calls use MT_CUBLAS_CHECK
// of cublas_check.h). Usable from .cu and .cpp files (no host-only headers).
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define MT_CUDA_CHECK(call)                                                                                    \
  do {                                                                                                         \
    const cudaError_t mt_status_ = (call);                                                                     \
    if (mt_status_ != cudaSuccess) [[unlikely]] {                                                              \
      ::moetrain::throw_error(__FILE__, __LINE__,                                                              \
                              ::fmt::format("CUDA: {} failed: {} ({})", #call, cudaGetErrorString(mt_status_), \
                                            static_cast<int>(mt_status_)));                                    \
    }                                                                                                          \
  } while (0)

#define MT_CUDA_CHECK_LAUNCH(kernel_name) MT_CUDA_CHECK(cudaGetLastError())
