// defines: the helpers the CUDA op tests (tests/ops/cuda_*_test.cpp) share to compare a GPU run with the CPU
// reference: the GPU's default stream, copies to and from device 0, host f32 views for relative_error, bf16
// rounding, bitwise equality, and (from testing/error_message.h) expecting an error whose message holds given phrases.
// Header-only.
#pragma once

#include <cstring>

#include <gtest/gtest.h>

#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"
#include "testing/error_message.h"

namespace moetrain::testing {

// The default stream of CUDA device 0, on which the GPU tests run the ops.
inline Stream& gpu() { return default_stream(Device::cuda(0)); }
inline Tensor on_gpu(const Tensor& t) { return t.to(Device::cuda(0)); }
inline Tensor on_cpu(const Tensor& t) { return t.to(Device::cpu()); }

// A device result as a host f32 tensor (bf16 widens exactly), so relative_error can read it.
inline Tensor host_f32(const Tensor& t) {
  const Tensor host = t.to(Device::cpu());
  return host.dtype() == DType::F32 ? host : host.to(DType::F32);
}

// The value a bf16 tensor carries, as f32: what the CPU reference computes from.
inline Tensor rounded_to_bf16(const Tensor& f32) { return f32.to(DType::BF16).to(DType::F32); }

// Whether two tensors (on any devices) hold the same dtype and the same bytes.
inline bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.dtype() == hb.dtype() && ha.nbytes() == hb.nbytes() &&
         std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

}  // namespace moetrain::testing
