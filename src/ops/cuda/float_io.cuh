// defines: the element loads and stores the CUDA kernels share: f32 and bf16 storage read into f32
// registers and written back with round-to-nearest-even (the rule of core/dtype.h).
#pragma once

#include <cuda_bf16.h>

namespace moetrain::ops::cuda {

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

}  // namespace moetrain::ops::cuda
