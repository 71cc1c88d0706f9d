// defines: the device code every CUDA rope kernel shares (ops/cuda/rope.cu, ops/cuda/norm_rope.cu): the cos and sin
// of a (position, frequency), and the rotation of one pair, each product and sum rounded to f32 on its own (the
// round-to-nearest intrinsics, which nvcc never fuses into a multiply-add) as the CPU's -ffp-contract=off code does.
#pragma once

#include <cstdint>

namespace moetrain::ops::cuda {

// c = cos(angle) * scaling and s = sin(angle) * scaling, angle = f32(position) * inv_freq in f32 (HF's angle).
__device__ __forceinline__ void rope_cos_sin(int32_t position, float inv_freq, float scaling, float* c, float* s) {
  const float angle = __fmul_rn(static_cast<float>(position), inv_freq);
  *c = __fmul_rn(cosf(angle), scaling);
  *s = __fmul_rn(sinf(angle), scaling);
}

// The pair (a, b) rotated by (c, s): (a c - b s, b c + a s). The backward, the transpose, passes -s.
__device__ __forceinline__ float rotated_first(float a, float b, float c, float s) {
  return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
__device__ __forceinline__ float rotated_second(float a, float b, float c, float s) {
  return __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

}  // namespace moetrain::ops::cuda
