// defines: the row layout the CUDA RMSNorm kernels share (ops/cuda/norm.cu, ops/cuda/norm_rope.cu): a warp, or a
// quarter or half of one for narrow rows, per row; the butterfly that sums a row's lanes; the norm's scale; and the
// host side's launch shapes and dtype dispatch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda::norm_rows {

constexpr int kWarpsPerBlock = 8;
constexpr int kRowThreads = 32 * kWarpsPerBlock;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this

// Butterfly sum over a row's Lanes lanes (a warp holds 32 / Lanes rows): every lane ends with the same bits (each step
// adds the same two values, a + b and b + a), in an order fixed by the lane layout. Every lane of the warp calls it.
template <int Lanes>
__device__ __forceinline__ float row_sum(float v) {
  for (int offset = Lanes / 2; offset > 0; offset >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// A row's lanes: Lanes lanes of a warp take one row, so a warp walks 32 / Lanes rows at a time. The row kernels give a
// row of D elements in spans of K the fewest lanes that hold all its spans (Lanes = the power of two at or above
// ceil(D / K), at least 8, at most 32). The bits are those of a whole warp per row: a warp's extra lanes would hold
// zero sums (never -0: each sum starts at +0), which the butterfly's first steps add exactly. Lanes of a row past the
// last one run the butterflies with zeros and store nothing.
template <int Lanes>
struct RowLanes {
  static constexpr int kRowsPerWarp = 32 / Lanes;
  int lane;     // the lane within the row
  int64_t row;  // the row
  bool active;  // row < rows
};

template <int Lanes, typename F>
__device__ __forceinline__ void for_each_row(int64_t rows, F&& f) {
  constexpr int kRowsPerWarp = RowLanes<Lanes>::kRowsPerWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t first = warp * kRowsPerWarp; first < rows; first += warps * kRowsPerWarp) {
    const int64_t row = first + static_cast<int64_t>(threadIdx.x % 32) / Lanes;
    f(RowLanes<Lanes>{static_cast<int>(threadIdx.x % Lanes), row, row < rows});
  }
}

__device__ __forceinline__ float scale_of(float w, bool zero_centered) {
  return zero_centered ? __fadd_rn(1.0f, w) : w;
}

// A lane's elements of a row: spans of K consecutive elements at lane * K, lane * K + 32 K, ... K = 8 (16-byte
// accesses) when the row allows (spans_of_8), else K = 1 (elements lane, lane + 32, ...). Within a span the elements
// are taken in ascending order, so a row's sums run in an order fixed by D and K alone.
template <int K>
__device__ __forceinline__ void load_scale(const float* w, bool zero_centered, float (&v)[K]) {
  load_span<K>(w, v);
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = scale_of(v[i], zero_centered);
}

inline cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

inline unsigned row_blocks(int64_t rows, int lanes) {
  const int64_t rows_per_block = int64_t{kWarpsPerBlock} * (32 / lanes);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// The lanes a row of `dim` elements takes in spans of 8 (`packed`) or 1 (RowLanes).
inline int row_lanes(int64_t dim, bool packed) {
  const int64_t spans = packed ? dim / 8 : dim;
  return spans <= 8 ? 8 : spans <= 16 ? 16 : 32;
}

// Calls f with the row lanes of row_lanes as a compile-time constant.
template <typename F>
void with_row_lanes(int lanes, F&& f) {
  if (lanes == 8) {
    f.template operator()<8>();
  } else if (lanes == 16) {
    f.template operator()<16>();
  } else {
    f.template operator()<32>();
  }
}

// Calls f(T*) with t's element type, f32 or bf16.
template <typename F>
void dispatch_activation(const Tensor& t, const char* op, F&& f) {
  switch (t.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: MT_FAIL("{} (CUDA): expected activations in f32 or bf16 but found {}", op, t.describe());
  }
}

// The same over two tensors' element types: f(T0*, T1*).
template <typename F>
void dispatch_activations(const Tensor& t0, const Tensor& t1, const char* op, F&& f) {
  dispatch_activation(t0, op, [&]<typename T0>(T0*) {
    dispatch_activation(t1, op, [&]<typename T1>(T1*) { f(static_cast<T0*>(nullptr), static_cast<T1*>(nullptr)); });
  });
}

}  // namespace moetrain::ops::cuda::norm_rows
