// defines: MT_REQUIRE_GPU(), the first line of every GPU test: skips the test with a message when
// no CUDA device is visible (CI, the development machine), else sets the backend up on device 0.
// GPU test suites are named Cuda* so CTest labels them `gpu` (tests/CMakeLists.txt).
#pragma once

#include <gtest/gtest.h>

#include "ops/cuda/runtime.h"

#define MT_REQUIRE_GPU()                                          \
  do {                                                            \
    if (::moetrain::ops::cuda::device_count() == 0) {             \
      GTEST_SKIP() << "no CUDA device visible: GPU test skipped"; \
    }                                                             \
    ::moetrain::ops::cuda::setup_cuda(0);                         \
  } while (0)
