// defines: helpers every CPU kernel uses: float-dtype dispatch (f32 for running, f64 for gradient
// checks) and the device guard of the public op functions.
#pragma once

#include <string_view>

#include "core/error.h"
#include "core/tensor.h"

namespace moetrain::ops::cpu {

// Calls f.template operator()<T>() with T = float or double for dtype f32 or f64.
template <typename F>
void dispatch_float(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::F32: f.template operator()<float>(); return;
    case DType::F64: f.template operator()<double>(); return;
    default: MT_FAIL("{}: the CPU reference computes in f32 or f64 but found {}", op, dtype_name(dtype));
  }
}

}  // namespace moetrain::ops::cpu

namespace moetrain::ops {

// The CPU reference is the only backend until the CUDA one lands (issue "CUDA backend"); an op
// given device tensors says so instead of touching device memory from the host.
inline void require_cpu(const Tensor& t, std::string_view op) {
  MT_CHECK(t.device().is_cpu(), "{}: no kernel for {} in this build (tensor {})", op, t.device().str(), t.describe());
}

}  // namespace moetrain::ops
