// defines: the CUDA attention kernels (ops/cuda/attention.h): a flash-attention style forward with an f32 online
// softmax, and a backward in three kernels (row terms, dq per query tile, dk / dv per key tile) without atomics.
#include "ops/cuda/attention.h"

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/attention_mma.h"
#include "ops/cuda/attention_row.cuh"
#include "ops/cuda/attention_tiles.cuh"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kWarps = kThreads / 32;
// Forward and dq: key tiles of 64, two keys per lane (attention_row.cuh).
using attention_row::kFullMask;
using attention_row::kKeysPerLane;
using attention_row::kKeyTile;
constexpr int kQueryTile = 32;  // dk / dv: a query tile of 32, one query per lane
constexpr int kMaxHeadDim = 256;

// A kernel's tile shape: the head-dim columns a lane owns (lane + 32 c for c < kChunks, so head dims up to 32 kChunks)
// and the query rows (forward, dq) or key rows (dk, dv) a warp owns. Head dims up to 128 take 8 rows per warp (tiles
// of 64 rows); up to 256, 4 rows per warp (32), so that the f32 tiles in shared memory stay within what a block may
// have (227 KiB) and the per-lane accumulators within the registers.
template <int CHUNKS, int ROWS>
struct TileShape {
  static constexpr int kChunks = CHUNKS;
  static constexpr int kRowsPerWarp = ROWS;
  static constexpr int kRowTile = kWarps * ROWS;
};
using NarrowTiles = TileShape<4, 8>;  // head dims <= 128
using WideTiles = TileShape<8, 4>;    // head dims <= 256
using attention_row::from_f32;
using attention_row::to_f32;
using attention_row::warp_max;
using attention_row::warp_sum;

struct Dims {
  int tokens, nh, nkv, hd, hdv, group, num_docs;
  float scale;
  bool causal;
  int window;  // 0: unlimited; clamped to < tokens by the launcher so that i + window fits an int
};

using namespace attention_tiles;

int num_tiles(const Dims& n, int tile_rows) { return n.tokens / tile_rows + n.num_docs; }

// Copies rows [0, rows) x cols of a strided global matrix into shared memory as f32 (row stride dst_stride);
// rows [rows_valid, rows) are zero.
template <typename T>
__device__ void load_rows(float* dst, int dst_stride, const T* src, int64_t src_stride, int rows_valid, int rows,
                          int cols) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int r = idx / cols, c = idx - r * cols;
    dst[r * dst_stride + c] = r < rows_valid ? to_f32(src[r * src_stride + c]) : 0.0f;
  }
}

// One block per (query tile, head). Each warp owns kRowsPerWarp query rows; for every key tile it computes the
// scores of its rows against the tile (two keys per lane), updates the running max / sum of each row and adds the
// tile's probabilities times V into per-lane accumulators (columns lane + 32 c). The per-row arithmetic is
// attention_row.cuh's, which the decoding step (attention_decode.cu) repeats for one row: keep the two in step.
template <typename T, class S>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu, Dims n) {
  constexpr int kRowsPerWarp = S::kRowsPerWarp, kRowTile = S::kRowTile, kChunks = S::kChunks;
  extern __shared__ float smem[];
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kRowTile, &tile)) return;
  const int h = static_cast<int>(blockIdx.y), g = h / n.group;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int qs = n.hd + 1, vs = n.hdv + 1;  // padded row strides: lanes reading a column hit distinct banks
  float* q_s = smem;                        // [kRowTile][qs]
  float* k_s = q_s + kRowTile * qs;         // [kKeyTile][qs]
  float* v_s = k_s + kKeyTile * qs;         // [kKeyTile][vs]
  float* p_s = v_s + kKeyTile * vs;         // [kRowTile][kKeyTile]
  const int64_t q_stride = static_cast<int64_t>(n.nh) * n.hd;
  const int64_t k_stride = static_cast<int64_t>(n.nkv) * n.hd;
  const int64_t v_stride = static_cast<int64_t>(n.nkv) * n.hdv;
  load_rows(q_s, qs, q + tile.begin * q_stride + static_cast<int64_t>(h) * n.hd, q_stride, tile.end - tile.begin,
            kRowTile, n.hd);

  int row_kb[kRowsPerWarp], row_ke[kRowsPerWarp];
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = tile.begin + warp * kRowsPerWarp + r;
    row_kb[r] = i < tile.end ? key_begin(i, tile.doc_begin, n) : 0;
    row_ke[r] = i < tile.end ? key_end(i, tile.doc_end, n) : 0;
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[r][c] = 0.0f;
  }

  // Key tiles start at the document's first token, whatever tile of queries this is.
  const int kb = key_begin(tile.begin, tile.doc_begin, n), ke = key_end(tile.end - 1, tile.doc_end, n);
  for (int k0 = tile.doc_begin + (kb - tile.doc_begin) / kKeyTile * kKeyTile; k0 < ke; k0 += kKeyTile) {
    const int nk = min(kKeyTile, ke - k0);
    __syncthreads();  // the previous tile's reads of k_s / v_s are done
    load_rows(k_s, qs, k + k0 * k_stride + static_cast<int64_t>(g) * n.hd, k_stride, nk, kKeyTile, n.hd);
    load_rows(v_s, vs, v + k0 * v_stride + static_cast<int64_t>(g) * n.hdv, v_stride, nk, nk, n.hdv);
    __syncthreads();

    float s[kRowsPerWarp][kKeysPerLane] = {};
    for (int d = 0; d < n.hd; ++d) {
      float kv[kKeysPerLane];
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) kv[kk] = k_s[(lane + 32 * kk) * qs + d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float qv = q_s[(warp * kRowsPerWarp + r) * qs + d];
#pragma unroll
        for (int kk = 0; kk < kKeysPerLane; ++kk) s[r][kk] = attention_row::score_step(qv, kv[kk], s[r][kk]);
      }
    }

#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      float p[kKeysPerLane];
      attention_row::update_row(s[r], k0, lane, row_kb[r], row_ke[r], n.scale, m[r], l[r], acc[r], p);
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) p_s[(warp * kRowsPerWarp + r) * kKeyTile + lane + 32 * kk] = p[kk];
    }
    __syncwarp();

    for (int j = 0; j < nk; ++j) {
      float vv[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) vv[c] = lane + 32 * c < n.hdv ? v_s[j * vs + lane + 32 * c] : 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        attention_row::add_value(p_s[(warp * kRowsPerWarp + r) * kKeyTile + j], vv, acc[r]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = tile.begin + warp * kRowsPerWarp + r;
    if (i >= tile.end) continue;
    const int64_t pair = static_cast<int64_t>(i) * n.nh + h;
    attention_row::write_row(out + pair * n.hdv, lse + pair, acc[r], m[r], l[r], lane, n.hdv);
  }
}

// row_term[i, h] = dot(dout[i, h], out[i, h]), one warp per (token, head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    row_term_kernel(float* row_term, const T* dout, const T* out, int64_t pairs, int hdv) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (pair >= pairs) return;
  float s = 0.0f;
  for (int c = lane; c < hdv; c += 32) s = fmaf(to_f32(dout[pair * hdv + c]), to_f32(out[pair * hdv + c]), s);
  s = warp_sum(s);
  if (lane == 0) row_term[pair] = s;
}

// dq_i = scale * sum_j p_ij (dp_ij - D_i) k_j, p_ij = exp(scale q_i.k_j - lse_i), dp_ij = dout_i.v_j. One block per
// (query tile, head), the layout of the forward; every dq element is one chain over ascending keys.
template <typename T, class S>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* row_term,
              const int32_t* cu, Dims n) {
  constexpr int kRowsPerWarp = S::kRowsPerWarp, kRowTile = S::kRowTile, kChunks = S::kChunks;
  extern __shared__ float smem[];
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kRowTile, &tile)) return;
  const int h = static_cast<int>(blockIdx.y), g = h / n.group;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int qs = n.hd + 1, vs = n.hdv + 1;
  float* q_s = smem;                  // [kRowTile][qs]
  float* do_s = q_s + kRowTile * qs;  // [kRowTile][vs]
  float* k_s = do_s + kRowTile * vs;  // [kKeyTile][qs]
  float* v_s = k_s + kKeyTile * qs;   // [kKeyTile][vs]
  float* ds_s = v_s + kKeyTile * vs;  // [kRowTile][kKeyTile]
  const int64_t q_stride = static_cast<int64_t>(n.nh) * n.hd;
  const int64_t o_stride = static_cast<int64_t>(n.nh) * n.hdv;
  const int64_t k_stride = static_cast<int64_t>(n.nkv) * n.hd;
  const int64_t v_stride = static_cast<int64_t>(n.nkv) * n.hdv;
  const int rows = tile.end - tile.begin;
  load_rows(q_s, qs, q + tile.begin * q_stride + static_cast<int64_t>(h) * n.hd, q_stride, rows, kRowTile, n.hd);
  load_rows(do_s, vs, dout + tile.begin * o_stride + static_cast<int64_t>(h) * n.hdv, o_stride, rows, kRowTile, n.hdv);

  int row_kb[kRowsPerWarp], row_ke[kRowsPerWarp];
  float row_lse[kRowsPerWarp], row_d[kRowsPerWarp], acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = tile.begin + warp * kRowsPerWarp + r;
    const bool valid = i < tile.end;
    const int64_t pair = static_cast<int64_t>(valid ? i : tile.begin) * n.nh + h;
    row_kb[r] = valid ? key_begin(i, tile.doc_begin, n) : 0;
    row_ke[r] = valid ? key_end(i, tile.doc_end, n) : 0;
    row_lse[r] = lse[pair];
    row_d[r] = row_term[pair];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[r][c] = 0.0f;
  }

  const int kb = key_begin(tile.begin, tile.doc_begin, n), ke = key_end(tile.end - 1, tile.doc_end, n);
  for (int k0 = tile.doc_begin + (kb - tile.doc_begin) / kKeyTile * kKeyTile; k0 < ke; k0 += kKeyTile) {
    const int nk = min(kKeyTile, ke - k0);
    __syncthreads();
    load_rows(k_s, qs, k + k0 * k_stride + static_cast<int64_t>(g) * n.hd, k_stride, nk, kKeyTile, n.hd);
    load_rows(v_s, vs, v + k0 * v_stride + static_cast<int64_t>(g) * n.hdv, v_stride, nk, kKeyTile, n.hdv);
    __syncthreads();

    float s[kRowsPerWarp][kKeysPerLane] = {}, dp[kRowsPerWarp][kKeysPerLane] = {};
    for (int d = 0; d < n.hd; ++d) {
      float kv[kKeysPerLane];
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) kv[kk] = k_s[(lane + 32 * kk) * qs + d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float qv = q_s[(warp * kRowsPerWarp + r) * qs + d];
#pragma unroll
        for (int kk = 0; kk < kKeysPerLane; ++kk) s[r][kk] = fmaf(qv, kv[kk], s[r][kk]);
      }
    }
    for (int d = 0; d < n.hdv; ++d) {
      float vv[kKeysPerLane];
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) vv[kk] = v_s[(lane + 32 * kk) * vs + d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float ov = do_s[(warp * kRowsPerWarp + r) * vs + d];
#pragma unroll
        for (int kk = 0; kk < kKeysPerLane; ++kk) dp[r][kk] = fmaf(ov, vv[kk], dp[r][kk]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) {
        const int j = k0 + lane + 32 * kk;
        float ds = 0.0f;
        if (j >= row_kb[r] && j < row_ke[r]) {
          const float p = expf(s[r][kk] * n.scale - row_lse[r]);
          ds = p * (dp[r][kk] - row_d[r]);
        }
        ds_s[(warp * kRowsPerWarp + r) * kKeyTile + lane + 32 * kk] = ds;
      }
    }
    __syncwarp();

    for (int j = 0; j < nk; ++j) {
      float kv[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) kv[c] = lane + 32 * c < n.hd ? k_s[j * qs + lane + 32 * c] : 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float ds = ds_s[(warp * kRowsPerWarp + r) * kKeyTile + j];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) acc[r][c] = fmaf(ds, kv[c], acc[r][c]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = tile.begin + warp * kRowsPerWarp + r;
    if (i >= tile.end) continue;
    const int64_t pair = static_cast<int64_t>(i) * n.nh + h;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = lane + 32 * c;
      if (col < n.hd) dq[pair * n.hd + col] = from_f32<T>(acc[r][c] * n.scale);
    }
  }
}

// dv_j = sum_{h, i} p_ij dout_i and dk_j = scale * sum_{h, i} p_ij (dp_ij - D_i) q_i over the query heads h of kv
// head g (ascending) and, within a head, the queries i that see key j (ascending). One block per (key tile, kv
// head); each warp owns kRowsPerWarp keys, each lane one query of the current query tile.
template <typename T, class S>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
                const float* row_term, const int32_t* cu, Dims n) {
  constexpr int kRowsPerWarp = S::kRowsPerWarp, kRowTile = S::kRowTile, kChunks = S::kChunks;
  extern __shared__ float smem[];
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kRowTile, &tile)) return;
  const int g = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int qs = n.hd + 1, vs = n.hdv + 1;
  float* k_s = smem;                            // [kRowTile][qs]
  float* v_s = k_s + kRowTile * qs;             // [kRowTile][vs]
  float* q_s = v_s + kRowTile * vs;             // [kQueryTile][qs]
  float* do_s = q_s + kQueryTile * qs;          // [kQueryTile][vs]
  float* p_s = do_s + kQueryTile * vs;          // [kRowTile][kQueryTile]
  float* ds_s = p_s + kRowTile * kQueryTile;    // [kRowTile][kQueryTile]
  float* lse_s = ds_s + kRowTile * kQueryTile;  // [kQueryTile]
  float* d_s = lse_s + kQueryTile;              // [kQueryTile]
  const int64_t q_stride = static_cast<int64_t>(n.nh) * n.hd;
  const int64_t o_stride = static_cast<int64_t>(n.nh) * n.hdv;
  const int64_t k_stride = static_cast<int64_t>(n.nkv) * n.hd;
  const int64_t v_stride = static_cast<int64_t>(n.nkv) * n.hdv;
  const int rows = tile.end - tile.begin;
  load_rows(k_s, qs, k + tile.begin * k_stride + static_cast<int64_t>(g) * n.hd, k_stride, rows, kRowTile, n.hd);
  load_rows(v_s, vs, v + tile.begin * v_stride + static_cast<int64_t>(g) * n.hdv, v_stride, rows, kRowTile, n.hdv);

  int row_qb[kRowsPerWarp], row_qe[kRowsPerWarp];
  float dk_acc[kRowsPerWarp][kChunks], dv_acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int j = tile.begin + warp * kRowsPerWarp + r;
    row_qb[r] = j < tile.end ? query_begin(j, tile.doc_begin, n) : 0;
    row_qe[r] = j < tile.end ? query_end(j, tile.doc_end, n) : 0;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) dk_acc[r][c] = dv_acc[r][c] = 0.0f;
  }

  const int qb = query_begin(tile.begin, tile.doc_begin, n), qe = query_end(tile.end - 1, tile.doc_end, n);
  for (int h = g * n.group; h < (g + 1) * n.group; ++h) {
    for (int i0 = qb; i0 < qe; i0 += kQueryTile) {
      const int nq = min(kQueryTile, qe - i0);
      __syncthreads();  // the previous query tile's reads are done
      const int64_t head = static_cast<int64_t>(i0) * n.nh + h;
      load_rows(q_s, qs, q + head * n.hd, q_stride, nq, kQueryTile, n.hd);
      load_rows(do_s, vs, dout + head * n.hdv, o_stride, nq, kQueryTile, n.hdv);
      if (static_cast<int>(threadIdx.x) < kQueryTile) {
        const int t = static_cast<int>(threadIdx.x);
        lse_s[t] = t < nq ? lse[head + static_cast<int64_t>(t) * n.nh] : 0.0f;
        d_s[t] = t < nq ? row_term[head + static_cast<int64_t>(t) * n.nh] : 0.0f;
      }
      __syncthreads();

      float s[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
      for (int d = 0; d < n.hd; ++d) {
        const float qv = q_s[lane * qs + d];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) s[r] = fmaf(k_s[(warp * kRowsPerWarp + r) * qs + d], qv, s[r]);
      }
      for (int d = 0; d < n.hdv; ++d) {
        const float ov = do_s[lane * vs + d];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) dp[r] = fmaf(v_s[(warp * kRowsPerWarp + r) * vs + d], ov, dp[r]);
      }
      const int i = i0 + lane;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float p = 0.0f, ds = 0.0f;
        if (lane < nq && i >= row_qb[r] && i < row_qe[r]) {
          p = expf(s[r] * n.scale - lse_s[lane]);
          ds = p * (dp[r] - d_s[lane]);
        }
        p_s[(warp * kRowsPerWarp + r) * kQueryTile + lane] = p;
        ds_s[(warp * kRowsPerWarp + r) * kQueryTile + lane] = ds;
      }
      __syncwarp();

      for (int ii = 0; ii < nq; ++ii) {
        float ov[kChunks], qv[kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int col = lane + 32 * c;
          ov[c] = col < n.hdv ? do_s[ii * vs + col] : 0.0f;
          qv[c] = col < n.hd ? q_s[ii * qs + col] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const float p = p_s[(warp * kRowsPerWarp + r) * kQueryTile + ii];
          const float ds = ds_s[(warp * kRowsPerWarp + r) * kQueryTile + ii];
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            dv_acc[r][c] = fmaf(p, ov[c], dv_acc[r][c]);
            dk_acc[r][c] = fmaf(ds, qv[c], dk_acc[r][c]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int j = tile.begin + warp * kRowsPerWarp + r;
    if (j >= tile.end) continue;
    const int64_t pair = static_cast<int64_t>(j) * n.nkv + g;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = lane + 32 * c;
      if (col < n.hd) dk[pair * n.hd + col] = from_f32<T>(dk_acc[r][c] * n.scale);
      if (col < n.hdv) dv[pair * n.hdv + col] = from_f32<T>(dv_acc[r][c]);
    }
  }
}

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params,
             const char* op) {
  const int64_t tokens = q.size(0), nh = q.size(1), nkv = k.size(1), hd = q.size(2), hdv = v.size(2);
  MT_CHECK(hd >= 1 && hd <= kMaxHeadDim && hdv >= 1 && hdv <= kMaxHeadDim,
           "{}: the CUDA kernels take head dims in [1, {}] but found hd = {} (q, k) and hdv = {} (v)", op, kMaxHeadDim,
           hd, hdv);
  // Token indices and tile counts are ints (offsets are 64-bit); heads index the grid's y dimension.
  MT_CHECK(tokens <= (int64_t{1} << 30) && nh <= 65535,
           "{}: the CUDA kernels take at most 2^30 tokens and 65535 heads but found T = {}, nh = {}", op, tokens, nh);
  Dims n{};
  n.tokens = static_cast<int>(tokens);
  n.nh = static_cast<int>(nh);
  n.nkv = static_cast<int>(nkv);
  n.hd = static_cast<int>(hd);
  n.hdv = static_cast<int>(hdv);
  n.group = static_cast<int>(nh / nkv);
  n.num_docs = static_cast<int>(cu_seqlens.numel() - 1);
  n.scale = params.softmax_scale;
  n.causal = params.causal;
  // A window of at least T keys restricts nothing; clamping keeps i + window inside an int.
  n.window = params.sliding_window >= tokens ? 0 : params.sliding_window;
  return n;
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

template <class S>
size_t forward_smem_bytes(const Dims& n) {
  constexpr int kRowTile = S::kRowTile;
  return sizeof(float) * (static_cast<size_t>(kRowTile + kKeyTile) * (n.hd + 1) +
                          static_cast<size_t>(kKeyTile) * (n.hdv + 1) + static_cast<size_t>(kRowTile) * kKeyTile);
}

template <class S>
size_t dq_smem_bytes(const Dims& n) {
  constexpr int kRowTile = S::kRowTile;
  return sizeof(float) *
         (static_cast<size_t>(kRowTile + kKeyTile) * (n.hd + 1 + n.hdv + 1) + static_cast<size_t>(kRowTile) * kKeyTile);
}

template <class S>
size_t dkdv_smem_bytes(const Dims& n) {
  constexpr int kRowTile = S::kRowTile;
  return sizeof(float) * (static_cast<size_t>(kRowTile + kQueryTile) * (n.hd + 1 + n.hdv + 1) +
                          2 * static_cast<size_t>(kRowTile) * kQueryTile + 2 * static_cast<size_t>(kQueryTile));
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T, class S>
void forward_typed(cudaStream_t stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, const Tensor& cu_seqlens, const Dims& n) {
  const size_t smem = forward_smem_bytes<S>(n);
  allow_smem(forward_kernel<T, S>, smem);
  const dim3 grid(static_cast<unsigned>(num_tiles(n, S::kRowTile)), static_cast<unsigned>(n.nh));
  forward_kernel<T, S><<<grid, kThreads, smem, stream>>>(ptr<T>(out), ptr<float>(lse), ptr<const T>(q), ptr<const T>(k),
                                                         ptr<const T>(v), ptr<const int32_t>(cu_seqlens), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T, class S>
void backward_typed(cudaStream_t stream, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const Tensor& cu_seqlens, const Dims& n) {
  // The scratch comes from the device's stream-ordered pool; its release is ordered after these kernels.
  const Tensor row_term = Tensor::empty({n.tokens, n.nh}, DType::F32, q.device());
  const int64_t pairs = static_cast<int64_t>(n.tokens) * n.nh;
  row_term_kernel<T><<<static_cast<unsigned>((pairs + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
      ptr<float>(row_term), ptr<const T>(dout), ptr<const T>(out), pairs, n.hdv);
  MT_CUDA_CHECK(cudaGetLastError());

  const size_t dq_smem = dq_smem_bytes<S>(n);
  allow_smem(dq_kernel<T, S>, dq_smem);
  const dim3 dq_grid(static_cast<unsigned>(num_tiles(n, S::kRowTile)), static_cast<unsigned>(n.nh));
  dq_kernel<T, S><<<dq_grid, kThreads, dq_smem, stream>>>(
      ptr<T>(dq), ptr<const T>(dout), ptr<const T>(q), ptr<const T>(k), ptr<const T>(v), ptr<const float>(lse),
      ptr<const float>(row_term), ptr<const int32_t>(cu_seqlens), n);
  MT_CUDA_CHECK(cudaGetLastError());

  const size_t dkdv_smem = dkdv_smem_bytes<S>(n);
  allow_smem(dkdv_kernel<T, S>, dkdv_smem);
  const dim3 dkdv_grid(static_cast<unsigned>(num_tiles(n, S::kRowTile)), static_cast<unsigned>(n.nkv));
  dkdv_kernel<T, S><<<dkdv_grid, kThreads, dkdv_smem, stream>>>(
      ptr<T>(dk), ptr<T>(dv), ptr<const T>(dout), ptr<const T>(q), ptr<const T>(k), ptr<const T>(v),
      ptr<const float>(lse), ptr<const float>(row_term), ptr<const int32_t>(cu_seqlens), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params) {
  constexpr const char* op = "attention_forward";
  const Dims n = dims_of(q, k, v, cu_seqlens, params, op);
  // bf16 at head dims 64 / 128: the tensor-core kernels (attention_mma.h), with the same tiling and properties.
  if (mma_attention_supported(q.dtype(), n.hd, n.hdv)) {
    mma_attention_forward(stream, out, lse, q, k, v, cu_seqlens, params);
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const bool wide = n.hd > 32 * NarrowTiles::kChunks || n.hdv > 32 * NarrowTiles::kChunks;
  switch (q.dtype()) {
    case DType::F32:
      wide ? forward_typed<float, WideTiles>(s, out, lse, q, k, v, cu_seqlens, n)
           : forward_typed<float, NarrowTiles>(s, out, lse, q, k, v, cu_seqlens, n);
      return;
    case DType::BF16:
      wide ? forward_typed<__nv_bfloat16, WideTiles>(s, out, lse, q, k, v, cu_seqlens, n)
           : forward_typed<__nv_bfloat16, NarrowTiles>(s, out, lse, q, k, v, cu_seqlens, n);
      return;
    default: MT_FAIL("{}: the CUDA kernels take f32 or bf16 but found {}", op, q.describe());
  }
}

void attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params) {
  constexpr const char* op = "attention_backward";
  const Dims n = dims_of(q, k, v, cu_seqlens, params, op);
  if (mma_attention_supported(q.dtype(), n.hd, n.hdv)) {
    mma_attention_backward(stream, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params);
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  const bool wide = n.hd > 32 * NarrowTiles::kChunks || n.hdv > 32 * NarrowTiles::kChunks;
  switch (q.dtype()) {
    case DType::F32:
      wide ? backward_typed<float, WideTiles>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n)
           : backward_typed<float, NarrowTiles>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n);
      return;
    case DType::BF16:
      wide ? backward_typed<__nv_bfloat16, WideTiles>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n)
           : backward_typed<__nv_bfloat16, NarrowTiles>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n);
      return;
    default: MT_FAIL("{}: the CUDA kernels take f32 or bf16 but found {}", op, q.describe());
  }
}

}  // namespace moetrain::ops::cuda
