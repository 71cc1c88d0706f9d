// defines: the CUDA q/k norm + rope kernels. The norm's row layout (ops/cuda/norm_rows.cuh) with one 16-byte span of
// 8 elements per lane: lane l holds elements 8l .. 8l + 7 of its head, so the rotate-half partner of each element
// (i and i + hd / 2) sits at the same place in lane l ^ (Lanes / 2), one shuffle away. Each element's arithmetic is
// that of ops/cuda/norm.cu and ops/cuda/rope.cu in the same order, with the same roundings between them (the normed
// value rounded to the activation dtype before it is rotated; the rotated gradient rounded before the norm's backward
// reads it), so y, rstd and dx have the bits of the separate ops. A warp takes one token's heads at a time, so a lane
// reads its pairs' cos / sin once per token. The backward also sums the norm's weight-gradient terms from its
// registers (rope_norm_backward_kernel), in an order of its own.
#include "ops/cuda/norm_rope.h"

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/norm.h"
#include "ops/cuda/norm_rows.cuh"
#include "ops/cuda/rope.h"
#include "ops/cuda/rope_pairs.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

using namespace norm_rows;

// The cos / sin of a lane's 8 pairs at one token, from `table` [2, T, hd / 2]: a row's lane l and its partner l ^
// (Lanes / 2) rotate the same pairs. Loaded once per token and kept for all its heads: read again for each head, the
// table moved 2 bytes through L1 for every byte of a row (512 of cos / sin per 256 of a 128-wide bf16 row).
struct LanePairs {
  float c[8];
  float s[8];
};

template <int Lanes>
__device__ __forceinline__ LanePairs load_lane_pairs(const float* table, int64_t tokens, int64_t token, int lane) {
  constexpr int64_t kHalf = Lanes * 4;  // hd / 2 pairs
  const int64_t pair0 = token * kHalf + (lane % (Lanes / 2)) * 8;
  LanePairs p;
  load8(table + pair0, p.c);
  load8(table + tokens * kHalf + pair0, p.s);
  return p;
}

// Rotates a lane's span v (8 elements of a head) with its partner lane's span by the lane's pairs; sin_sign -1 applies
// the transpose. Every lane of the warp calls it (the shuffle); an inactive row's lanes leave v as it is.
template <int Lanes>
__device__ __forceinline__ void rotate_span(float (&v)[8], const RowLanes<Lanes>& at, const LanePairs& pairs,
                                            float sin_sign) {
  constexpr int kHalfLanes = Lanes / 2;
  float partner[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) partner[i] = __shfl_xor_sync(0xffffffffu, v[i], kHalfLanes);
  if (!at.active) return;
  const bool first = at.lane < kHalfLanes;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float si = pairs.s[i] * sin_sign;  // exact
    v[i] = first ? rotated_first(v[i], partner[i], pairs.c[i], si) : rotated_second(partner[i], v[i], pairs.c[i], si);
  }
}

// A warp per token: its rows (one per head, [T, heads, hd] row-major) 32 / Lanes at a time, row group g of the warp
// taking heads g, g + 32 / Lanes, ...; the warps stride over the tokens. f(at, pairs) with the token's LanePairs,
// loaded once for all its heads. The loop bounds are the warp's own, so every lane reaches every shuffle.
template <int Lanes, typename F>
__device__ __forceinline__ void for_each_token_row(int64_t tokens, int64_t heads, const float* table, F&& f) {
  constexpr int kRowsPerWarp = RowLanes<Lanes>::kRowsPerWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int lane = static_cast<int>(threadIdx.x % Lanes);
  const int group = static_cast<int>(threadIdx.x % 32) / Lanes;
  for (int64_t token = warp; token < tokens; token += warps) {
    const LanePairs pairs = load_lane_pairs<Lanes>(table, tokens, token, lane);
    for (int64_t first = 0; first < heads; first += kRowsPerWarp) {
      const int64_t head = first + group;
      f(RowLanes<Lanes>{lane, token * heads + head, head < heads}, pairs);
    }
  }
}

// A warp per token (for_each_token_row): the grid's blocks, a function of the token count alone.
unsigned token_blocks(int64_t tokens) {
  const int64_t blocks = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Four blocks an SM (64 registers): the token's pairs held across its heads cost 16 registers a lane, which would
// otherwise leave the backward three (80 registers) and the forward four to five (61-67).
constexpr int kBlocksPerSm = 4;

template <int Lanes, typename T>
__global__ __launch_bounds__(kRowThreads,
                             kBlocksPerSm) void norm_rope_forward_kernel(T* y, float* rstd, const T* x, const float* w,
                                                                         const float* table, int64_t tokens,
                                                                         int64_t heads, float eps, bool zero_centered) {
  constexpr int64_t kDim = Lanes * 8;
  for_each_token_row<Lanes>(tokens, heads, table, [&](const RowLanes<Lanes> at, const LanePairs& pairs) {
    const int64_t offset = at.row * kDim + at.lane * 8;
    float v[8] = {};
    if (at.active) load8(x + offset, v);
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_sq = __fadd_rn(sum_sq, __fmul_rn(v[i], v[i]));
    const float variance = __fdiv_rn(row_sum<Lanes>(sum_sq), static_cast<float>(kDim));
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
    if (at.lane == 0 && at.active) rstd[at.row] = r;
    float scale[8];
    load_scale<8>(w + at.lane * 8, zero_centered, scale);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = stored_value(__fmul_rn(__fmul_rn(v[i], r), scale[i]), y);
    rotate_span<Lanes>(v, at, pairs, 1.0f);
    if (at.active) store8(y + offset, v);
  });
}

// The input gradient as rope_backward then rmsnorm_backward_input compute it, and the norm's weight gradient terms
// d_normed * (x * rstd) as rmsnorm_backward_weight forms them: each lane sums its columns' terms over the rows its
// group takes (ascending), the block's row groups are added in order into partial[block] [hd], and add_column_sums
// takes the blocks' sums into dw. With the grid a function of the token count (weight_blocks) and the rows a warp takes
// a function of the token and head counts (for_each_token_row), so is every column's order of additions.
template <int Lanes, typename T>
__global__ __launch_bounds__(kRowThreads,
                             kBlocksPerSm) void rope_norm_backward_kernel(T* dx, float* partial, const T* d_rotated,
                                                                          const T* x, const float* w, const float* rstd,
                                                                          const float* table, int64_t tokens,
                                                                          int64_t heads, bool zero_centered) {
  constexpr int kDim = Lanes * 8;
  constexpr int kGroups = kWarpsPerBlock * (32 / Lanes);  // a block's row groups
  __shared__ float group_sums[kGroups][kDim];
  float terms[8] = {};
  for_each_token_row<Lanes>(tokens, heads, table, [&](const RowLanes<Lanes> at, const LanePairs& pairs) {
    const int64_t offset = at.row * kDim + at.lane * 8;
    float g[8] = {};
    if (at.active) load8(d_rotated + offset, g);
    rotate_span<Lanes>(g, at, pairs, -1.0f);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = stored_value(g[i], dx);  // d_normed as rope_backward stores it
    const float r = at.active ? rstd[at.row] : 0.0f;
    float xhat[8] = {}, scale[8];
    if (at.active) load8(x + offset, xhat);
    load_scale<8>(w + at.lane * 8, zero_centered, scale);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xhat[i] = __fmul_rn(xhat[i], r);
      if (at.active) terms[i] = __fadd_rn(terms[i], __fmul_rn(g[i], xhat[i]));
      g[i] = __fmul_rn(scale[i], g[i]);
      sum = __fadd_rn(sum, __fmul_rn(g[i], xhat[i]));
    }
    const float mean = __fdiv_rn(row_sum<Lanes>(sum), static_cast<float>(kDim));
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = __fmul_rn(r, __fsub_rn(g[i], __fmul_rn(xhat[i], mean)));
    if (at.active) store8(dx + offset, g);
  });
  const int group = static_cast<int>(threadIdx.x / Lanes), lane = static_cast<int>(threadIdx.x % Lanes);
#pragma unroll
  for (int i = 0; i < 8; ++i) group_sums[group][lane * 8 + i] = terms[i];
  __syncthreads();
  for (int column = static_cast<int>(threadIdx.x); column < kDim; column += static_cast<int>(blockDim.x)) {
    float total = group_sums[0][column];
    for (int other = 1; other < kGroups; ++other) total = __fadd_rn(total, group_sums[other][column]);
    partial[static_cast<int64_t>(blockIdx.x) * kDim + column] = total;
  }
}

// The backward's grid: a warp per token up to kMaxWeightBlocks blocks (the warps then stride over more tokens), a
// function of the token count alone, so the weight gradient's order is too.
constexpr int64_t kMaxWeightBlocks = 4096;
unsigned weight_blocks(int64_t tokens) {
  const unsigned blocks = token_blocks(tokens);
  return blocks < kMaxWeightBlocks ? blocks : static_cast<unsigned>(kMaxWeightBlocks);
}

// The lanes of the one-kernel form (8, 16 or 32), or 0 when the rows do not allow it.
int fused_lanes(const Stream& stream, const Tensor& x, const RopeParams& rope, std::initializer_list<const void*> bases,
                const char* op) {
  const int64_t dim = x.size(2);
  if (rope.interleaved || rope.rotary_dim != dim || (dim != 64 && dim != 128 && dim != 256)) return 0;
  if (!reduction_packs(stream, dim, 8, bases, op)) return 0;
  return static_cast<int>(dim / 8);
}

// The [2, T, hd / 2] cos / sin table of the rotation.
Tensor cos_sin_table(const Stream& stream, const Tensor& position_ids, const RopeParams& rope) {
  Tensor table = Tensor::empty({2, position_ids.numel(), rope.rotary_dim / 2}, DType::F32, position_ids.device());
  rope_cos_sin_table(stream, table, position_ids, rope);
  return table;
}

}  // namespace

void rmsnorm_rope_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                          const RmsNormParams& norm, const Tensor& position_ids, const RopeParams& rope) {
  constexpr const char* op = "rmsnorm_rope_forward";
  const int lanes = fused_lanes(stream, x, rope, {y.raw_data(), x.raw_data(), w.raw_data()}, op);
  if (lanes == 0) {
    rmsnorm_forward(stream, y, rstd, x, w, norm);
    rope_forward(stream, y, y, position_ids, rope);
    return;
  }
  const int64_t tokens = x.size(0);
  if (tokens * x.size(1) == 0) return;
  const Tensor table = cos_sin_table(stream, position_ids, rope);
  dispatch_activation(x, op, [&]<typename T>(T*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      norm_rope_forward_kernel<Lanes><<<token_blocks(tokens), kRowThreads, 0, native(stream)>>>(
          static_cast<T*>(y.raw_data()), static_cast<float*>(rstd.raw_data()), static_cast<const T*>(x.raw_data()),
          static_cast<const float*>(w.raw_data()), static_cast<const float*>(table.raw_data()), tokens, x.size(1),
          norm.eps, norm.zero_centered);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void rope_rmsnorm_backward(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& d_rotated,
                           const Tensor& x, const Tensor& w, const Tensor& rstd, const RmsNormParams& norm,
                           const Tensor& position_ids, const RopeParams& rope) {
  constexpr const char* op = "rope_rmsnorm_backward";
  const int lanes = fused_lanes(stream, x, rope, {dx.raw_data(), d_rotated.raw_data(), x.raw_data(), w.raw_data()}, op);
  if (lanes == 0) {
    const Tensor d_normed = Tensor::empty(d_rotated.shape(), d_rotated.dtype(), d_rotated.device());
    rope_backward(stream, d_normed, d_rotated, position_ids, rope);
    rmsnorm_backward_input(stream, dx, d_normed, x, w, rstd, norm);
    rmsnorm_backward_weight(stream, dw, d_normed, x, rstd);
    return;
  }
  const int64_t tokens = x.size(0);
  if (tokens * x.size(1) == 0) return;  // dw += an empty sum
  const Tensor table = cos_sin_table(stream, position_ids, rope);
  const unsigned blocks = weight_blocks(tokens);
  const Tensor partial = Tensor::empty({static_cast<int64_t>(blocks), x.size(2)}, DType::F32, x.device());
  dispatch_activation(x, op, [&]<typename T>(T*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      rope_norm_backward_kernel<Lanes><<<blocks, kRowThreads, 0, native(stream)>>>(
          static_cast<T*>(dx.raw_data()), static_cast<float*>(partial.raw_data()),
          static_cast<const T*>(d_rotated.raw_data()), static_cast<const T*>(x.raw_data()),
          static_cast<const float*>(w.raw_data()), static_cast<const float*>(rstd.raw_data()),
          static_cast<const float*>(table.raw_data()), tokens, x.size(1), norm.zero_centered);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
  add_column_sums(stream, dw, partial);
}

}  // namespace moetrain::ops::cuda
