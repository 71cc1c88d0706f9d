// defines: the element loads and stores the CUDA kernels share: f32 and bf16 storage read into f32
// registers and written back with round-to-nearest-even (the rule of core/dtype.h), one element or one 16-byte pack
// at a time.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>

#include "core/device.h"
#include "core/error.h"

namespace moetrain::ops::cuda {

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// The value a T element holds after store_float: f32 as is, bf16 rounded to nearest even.
__device__ __forceinline__ float stored_value(float v, const float*) { return v; }
__device__ __forceinline__ float stored_value(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// One 16-byte access: kPack<T> consecutive elements (4 f32 or 8 bf16) read into or written from f32 registers, with
// the rounding of store_float. The address must be 16-byte aligned.
template <typename T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ void load_pack(const float* p, float (&out)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void load_pack(const __nv_bfloat16* p, float (&out)[8]) {
  const uint4 x = *reinterpret_cast<const uint4*>(p);
  const auto* pair = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pair[i]);
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store_pack(float* p, const float (&in)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void store_pack(__nv_bfloat16* p, const float (&in)[8]) {
  uint4 x;
  auto* pair = reinterpret_cast<__nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) pair[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = x;
}

// Eight consecutive elements whatever the type (one 16-byte access in bf16, two in f32): kernels that mix an f32 and
// a bf16 tensor walk both in the same steps. The address must be 16-byte aligned.
__device__ __forceinline__ void load8(const float* p, float (&out)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&out)[8]) { load_pack(p, out); }
__device__ __forceinline__ void store8(float* p, const float (&in)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(in[4], in[5], in[6], in[7]);
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&in)[8]) { store_pack(p, in); }

// K consecutive elements: 8 through load8 / store8 (a kernel walking a row in spans of 8), or 1.
template <int K, typename T>
__device__ __forceinline__ void load_span(const T* p, float (&v)[K]) {
  if constexpr (K == 8) {
    load8(p, v);
  } else {
    v[0] = load_float(p);
  }
}
template <int K, typename T>
__device__ __forceinline__ void store_span(T* p, const float (&v)[K]) {
  if constexpr (K == 8) {
    store8(p, v);
  } else {
    store_float(p, v[0]);
  }
}

// Host side: rows of `width` elements from these bases can be walked in spans of 8 (width a multiple of 8 and every
// base 16-byte aligned, so every row's start is).
inline bool spans_of_8(int64_t width, std::initializer_list<const void*> bases) {
  if (width % 8 != 0) return false;
  for (const void* base : bases) {
    if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  }
  return true;
}

// Whether a kernel whose row sums follow its access layout (the norms, the cross-entropy) walks rows of `width` in
// packs of `pack` elements: when the width and every base allow it. Under the exact lanes' batch-invariant policy the
// layout, and so the order of the sums, must follow from the width alone: a width that allows packs with a base that
// does not is refused rather than summed in the other order.
inline bool reduction_packs(const Stream& stream, int64_t width, int pack, std::initializer_list<const void*> bases,
                            const char* op) {
  if (width % pack != 0) return false;
  for (const void* base : bases) {
    if (reinterpret_cast<uintptr_t>(base) % 16 == 0) continue;
    MT_CHECK(!batch_invariant(stream),
             "{} (batch-invariant): rows of {} elements are summed in packs of {}, which needs 16-byte aligned data, "
             "but a tensor starts at {}; the exact lanes do not sum them in another order",
             op, width, pack, base);
    return false;
  }
  return true;
}

}  // namespace moetrain::ops::cuda
