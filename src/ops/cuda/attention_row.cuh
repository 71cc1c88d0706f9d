// defines: the per-query-row arithmetic of the CUDA attention forward (one warp per row, key tiles of 64, an f32
// online softmax), shared by the training forward (ops/cuda/attention.cu) and the decoding step
// (ops/cuda/attention_decode.cu) so that both compute a query's out and lse with the same instructions, bit for bit.
#pragma once

#include <cmath>

#include <cuda_bf16.h>

namespace moetrain::ops::cuda::attention_row {

// Every floating-point step that nvcc could contract (a product feeding a sum) is written with an explicit
// round-to-nearest intrinsic: __fmul_rn, __fadd_rn, __fsub_rn, __fmaf_rn and __fdiv_rn compile to the .rn PTX
// instructions, which neither nvcc's front end nor ptxas fuses or splits. The results of a row then do not depend on
// the kernel around it (how many rows a warp holds, where its keys come from), only on the inputs.

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kKeysPerLane = 2;  // a key tile of 64: lane L holds keys k0 + L and k0 + L + 32
constexpr int kKeyTile = 32 * kKeysPerLane;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Butterfly reductions: every lane ends with the same bits (a + b == b + a in floating point).
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = __fadd_rn(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// One step of a score's chain s = sum_d q_d k_d, taken over d = 0 .. hd - 1 in ascending order from s = 0.
__device__ __forceinline__ float score_step(float q, float k, float s) { return __fmaf_rn(q, k, s); }

// The online-softmax update of one query row by one key tile [k0, k0 + 64): s are the lane's raw scores (keys
// k0 + lane + 32 kk), [kb, ke) the keys the row sees. Writes the lane's probabilities p (0 for keys the row does not
// see) and, when the row sees a key of the tile, rescales (m, l, acc) to the new running max. A tile the row sees no
// key of leaves the row unchanged (p = 0). Warp-uniform: every lane of the warp must call it.
template <int kChunks>
__device__ __forceinline__ void update_row(const float (&s)[kKeysPerLane], int k0, int lane, int kb, int ke,
                                           float scale, float& m, float& l, float (&acc)[kChunks],
                                           float (&p)[kKeysPerLane]) {
  float x[kKeysPerLane];
  float tile_max = -INFINITY;
#pragma unroll
  for (int kk = 0; kk < kKeysPerLane; ++kk) {
    const int j = k0 + lane + 32 * kk;
    x[kk] = (j >= kb && j < ke) ? __fmul_rn(s[kk], scale) : -INFINITY;
    tile_max = fmaxf(tile_max, x[kk]);
    p[kk] = 0.0f;
  }
  tile_max = warp_max(tile_max);
  if (tile_max != -INFINITY) {  // uniform over the warp
    const float m_new = fmaxf(m, tile_max);
    const float alpha = expf(__fsub_rn(m, m_new));  // 0 on the row's first visible tile (m = -inf)
    float part = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKeysPerLane; ++kk) {
      p[kk] = expf(__fsub_rn(x[kk], m_new));
      part = __fadd_rn(part, p[kk]);
    }
    l = __fmaf_rn(l, alpha, warp_sum(part));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[c] = __fmul_rn(acc[c], alpha);
    m = m_new;
  }
}

// acc += p v for one key: p its probability, v the lane's columns of its value row (lane + 32 c). The keys of a tile
// are added in ascending order, every key of [k0, k0 + nk) (those the row does not see with p = 0).
template <int kChunks>
__device__ __forceinline__ void add_value(float p, const float (&v)[kChunks], float (&acc)[kChunks]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) acc[c] = __fmaf_rn(p, v[c], acc[c]);
}

// The row's results: out_row[col] = acc / l for the lane's columns col = lane + 32 c < hdv, and *lse = m + log(l)
// from lane 0.
template <typename T, int kChunks>
__device__ __forceinline__ void write_row(T* out_row, float* lse, const float (&acc)[kChunks], float m, float l,
                                          int lane, int hdv) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = lane + 32 * c;
    if (col < hdv) out_row[col] = from_f32<T>(__fdiv_rn(acc[c], l));
  }
  if (lane == 0) *lse = __fadd_rn(m, logf(l));
}

}  // namespace moetrain::ops::cuda::attention_row
