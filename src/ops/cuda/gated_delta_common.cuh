// defines: what the sequential and the chunked gated delta kernels share (ops/cuda/gated_delta.cu,
// gated_delta_chunked.cu): the activation dtype dispatch and the fixed-order sum of the per-value-head dq / dk rows
// over the value heads that share a key head.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/float_io.cuh"

namespace moetrain::ops::cuda::gated_delta_detail {

// Calls f(T*) with T the activation type of x: float or __nv_bfloat16; anything else is an error naming `op`.
template <typename F>
void dispatch_activation(const Tensor& x, const char* op, F&& f) {
  switch (x.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: MT_FAIL("{} (CUDA): expected f32 or bf16 but found {}", op, x.describe());
  }
}

// dq[t, kh, i] = sum over the group's value heads m (ascending) of dq_heads[t, kh * group + m, i]; same for dk. D
// holds tokens, hk, hv, dk and group (the value heads per key head).
template <typename T, typename D>
__global__ void group_sum_kernel(T* dq, T* dk, const float* dq_heads, const float* dk_heads, D d) {
  const int64_t n = d.tokens * d.hk * d.dk;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % d.dk, kh = (e / d.dk) % d.hk, t = e / (int64_t(d.dk) * d.hk);
    float sq = 0.0f, sk = 0.0f;
    for (int m = 0; m < d.group; ++m) {
      const int64_t src = (t * d.hv + kh * d.group + m) * d.dk + i;
      sq += dq_heads[src];
      sk += dk_heads[src];
    }
    store_float(dq + e, sq);
    store_float(dk + e, sk);
  }
}

}  // namespace moetrain::ops::cuda::gated_delta_detail
