// defines: MT_CUBLAS_CHECK, the checking macro every cuBLAS / cuBLASLt call goes through: a failing status
// raises moetrain::Error naming the call, the status's name and its numeric value. Host code only (.cpp).
#pragma once

#include <cublasLt.h>

#include "core/error.h"

#define MT_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                 \
    const cublasStatus_t mt_cublas_status_ = (call);                                                   \
    if (mt_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                     \
      ::moetrain::throw_error(                                                                         \
          __FILE__, __LINE__,                                                                          \
          ::fmt::format("cuBLAS: {} failed: {} ({})", #call, cublasLtGetStatusName(mt_cublas_status_), \
                        static_cast<int>(mt_cublas_status_)));                                         \
    }                                                                                                  \
  } while (0)
