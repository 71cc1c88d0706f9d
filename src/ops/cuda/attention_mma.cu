// defines: the tensor-core attention kernels (ops/cuda/attention_mma.h): a flash-attention 2 style forward on
// mma.sync m16n8k16 bf16 with an f32 online softmax, its decoding step, and a backward without atomics (row terms,
// dq per query tile, dk / dv per key tile), with the tiling and reduction orders of ops/cuda/attention.cu.
#include "ops/cuda/attention_mma.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/attention_tiles.cuh"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpRows = 16;                   // the rows of one warp's mma tile
constexpr int kBlockRows = kWarps * kWarpRows;  // 64: the query tile (forward, dq) or key tile (dk, dv)
constexpr int kKeyTile = 64;                    // forward / dq / decode: key tiles of 64 from the document start
constexpr int kPad = 8;                         // shared rows padded by 16 bytes: ldmatrix's 8 rows hit all banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Dims {
  int tokens, nh, nkv, group, num_docs;
  float scale, scale_log2;  // softmax_scale and softmax_scale * log2(e): scores are kept in base 2
  bool causal;
  int window;  // 0: unlimited; clamped to < tokens as in attention.cu
};

using namespace attention_tiles;

// ---- PTX wrappers -----------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, the bytes past src_bytes (0 or 16) zero.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c += a b for a 16 x 16 bf16 tile a (row) and a 16 x 8 tile b (col), f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x (ex2.approx.ftz: one instruction, the same bits in every kernel; 2^-inf = +0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- warp-level products ----------------------------------------------------------------------------------------
// Fragments of a 16-row product: lane L holds rows L / 4 (elements 0, 1) and L / 4 + 8 (elements 2, 3) at columns
// 8 t + 2 (L % 4) + {0, 1} of column tile t. Every output element is one chain of mma steps over ascending k.

// acc[16][N] += A[16][K] B[N][K]^T: A's rows at a, B's at b (shared, row-major, strides sa, sb elements).
template <int N, int K>
__device__ __forceinline__ void gemm_abt(float (&acc)[N / 8][4], const bf16* a, int sa, const bf16* b, int sb,
                                         int lane) {
  const int r = lane % 8, sel = lane / 8;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a + (r + (sel % 2) * 8) * sa + kk * 16 + (sel / 2) * 8);
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      uint32_t bfr[4];
      ldsm_x4(bfr, b + (nn * 16 + r + (sel / 2) * 8) * sb + kk * 16 + (sel % 2) * 8);
      mma_bf16(acc[2 * nn], af, bfr[0], bfr[1]);
      mma_bf16(acc[2 * nn + 1], af, bfr[2], bfr[3]);
    }
  }
}

// acc[16][N] += P[16][K] B[K][N]: P in the fragment layout of a 16 x K product (f32, rounded to bf16 here), B's
// rows at b (shared, row-major, stride sb).
template <int N, int K>
__device__ __forceinline__ void gemm_pb(float (&acc)[N / 8][4], const float (&p)[K / 8][4], const bf16* b, int sb,
                                        int lane) {
  const int r = lane % 8, sel = lane / 8;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t af[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                            pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      uint32_t bfr[4];
      ldsm_x4_trans(bfr, b + (kk * 16 + r + (sel % 2) * 8) * sb + nn * 16 + (sel / 2) * 8);
      mma_bf16(acc[2 * nn], af, bfr[0], bfr[1]);
      mma_bf16(acc[2 * nn + 1], af, bfr[2], bfr[3]);
    }
  }
}

// Rows [0, rows) of HD bf16 columns from a strided global matrix into shared memory (row stride HD + kPad); rows
// [rows_valid, rows) are zero. `aligned`: every source row is 16-byte aligned (cp.async), else element loads (the
// same bytes land in shared memory).
template <int HD>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t src_stride, int rows_valid, int rows,
                                          bool aligned) {
  constexpr int kStride = HD + kPad, kChunks = HD / 8;
  for (int idx = static_cast<int>(threadIdx.x); idx < rows * kChunks; idx += static_cast<int>(blockDim.x)) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    bf16* d = dst + r * kStride + c;
    const bool valid = r < rows_valid;
    const bf16* s = src + (valid ? r : 0) * src_stride + c;
    if (aligned) {
      cp_async16(d, s, valid ? 16 : 0);
    } else {
      alignas(16) bf16 e[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) e[t] = valid ? s[t] : __float2bfloat16_rn(0.0f);
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(e);
    }
  }
}

// ---- the forward's per-tile row arithmetic, shared by forward_kernel and decode_kernel ---------------------------
// Every floating-point step outside the mma is an explicit round-to-nearest intrinsic (nothing to contract), so a
// row's results depend only on its inputs, not on the kernel around it.

// The key tiles a tile of 64 query rows walks (forward, dq): 64-key tiles counted from its document's first token,
// from the one holding the tile's first visible key to the one holding its last; the visible keys of one warp's 16
// rows; and the double-buffered load of a tile's keys and values.
struct KeyWalk {
  int first, count, end;                 // the first tile's first key, the number of tiles, one past the last key
  int warp_first, warp_begin, warp_end;  // the warp's first row, and the keys [begin, end) its rows see
  bool active;                           // the warp holds rows of the tile

  __device__ KeyWalk(const Tile& tile, const Dims& n, int warp) {
    const int kb = key_begin(tile.begin, tile.doc_begin, n);
    end = key_end(tile.end - 1, tile.doc_end, n);
    first = tile.doc_begin + (kb - tile.doc_begin) / kKeyTile * kKeyTile;
    count = (end - first + kKeyTile - 1) / kKeyTile;
    warp_first = tile.begin + warp * kWarpRows;
    active = warp_first < tile.end;
    const int warp_last = min(warp_first + kWarpRows, tile.end) - 1;
    warp_begin = active ? key_begin(warp_first, tile.doc_begin, n) : 0;
    warp_end = active ? key_end(warp_last, tile.doc_end, n) : 0;
  }

  // Tile `it` of kv head g into buffer it % 2 of k_s and v_s ([2][64][HD + kPad] each).
  template <int HD>
  __device__ void load(int it, bf16* k_s, bf16* v_s, const bf16* k, const bf16* v, int64_t k_stride, int g,
                       bool aligned) const {
    constexpr int kStride = HD + kPad;
    const int k0 = first + it * kKeyTile, nk = min(kKeyTile, end - k0), buf = it % 2;
    load_tile<HD>(k_s + buf * kKeyTile * kStride, k + k0 * k_stride + static_cast<int64_t>(g) * HD, k_stride, nk,
                  kKeyTile, aligned);
    load_tile<HD>(v_s + buf * kKeyTile * kStride, v + k0 * k_stride + static_cast<int64_t>(g) * HD, k_stride, nk,
                  kKeyTile, aligned);
  }
};

template <int HD>
struct RowTile {     // one warp's 16 query rows; a lane holds rows L / 4 (index 0) and L / 4 + 8 (index 1)
  float m[2], l[2];  // running max (base-2 scaled scores) and sum
  float acc[HD / 8][4];
};

template <int HD>
__device__ __forceinline__ void init_rows(RowTile<HD>& t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) t.m[h] = -INFINITY, t.l[h] = 0.0f;
#pragma unroll
  for (int c = 0; c < HD / 8; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) t.acc[c][e] = 0.0f;
  }
}

// One key tile [k0, k0 + 64) for the warp's rows (q_w: 16 rows; k_s, v_s: the tile's 64 rows, zero past the keys
// loaded). Row h of the lane sees keys [kb[h], ke[h]). A row that sees no key of the tile is left unchanged: its
// probabilities are 0, alpha is 1, and the P V product adds only zero products.
template <int HD>
__device__ __forceinline__ void forward_tile(RowTile<HD>& t, const bf16* q_w, const bf16* k_s, const bf16* v_s, int k0,
                                             const int (&kb)[2], const int (&ke)[2], float scale_log2, int lane) {
  constexpr int kStride = HD + kPad, kN = kKeyTile / 8;
  float s[kN][4];
#pragma unroll
  for (int c = 0; c < kN; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[c][e] = 0.0f;
  }
  gemm_abt<kKeyTile, HD>(s, q_w, kStride, k_s, kStride, lane);

  const int col0 = k0 + 2 * (lane % 4);
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int c = 0; c < kN; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e / 2, j = col0 + 8 * c + e % 2;
      const float x = (j >= kb[h] && j < ke[h]) ? __fmul_rn(s[c][e], scale_log2) : -INFINITY;
      s[c][e] = x;
      tile_max[h] = fmaxf(tile_max[h], x);
    }
  }
  float alpha[2], m_sub[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    const float m_new = fmaxf(t.m[h], tile_max[h]);
    const bool none = m_new == -INFINITY;  // the row has seen no key yet
    alpha[h] = none ? 1.0f : ex2(__fsub_rn(t.m[h], m_new));
    m_sub[h] = none ? 0.0f : m_new;
    t.m[h] = m_new;
  }
  float part[2] = {0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < kN; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e / 2;
      s[c][e] = ex2(__fsub_rn(s[c][e], m_sub[h]));
      part[h] = __fadd_rn(part[h], s[c][e]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    part[h] = __fadd_rn(part[h], __shfl_xor_sync(0xffffffffu, part[h], 1));
    part[h] = __fadd_rn(part[h], __shfl_xor_sync(0xffffffffu, part[h], 2));
    t.l[h] = __fmaf_rn(t.l[h], alpha[h], part[h]);
  }
#pragma unroll
  for (int c = 0; c < HD / 8; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) t.acc[c][e] = __fmul_rn(t.acc[c][e], alpha[e / 2]);
  }
  gemm_pb<HD, kKeyTile>(t.acc, s, v_s, kStride, lane);
}

// out = acc / l (bf16) and lse = m ln 2 + log(l) of the lane's rows h whose out_row[h] is non-null.
template <int HD>
__device__ __forceinline__ void write_rows(const RowTile<HD>& t, bf16* const (&out_row)[2], float* const (&lse)[2],
                                           int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (out_row[h] == nullptr) continue;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      const int col = 8 * c + 2 * (lane % 4);
      out_row[h][col] = __float2bfloat16_rn(__fdiv_rn(t.acc[c][2 * h], t.l[h]));
      out_row[h][col + 1] = __float2bfloat16_rn(__fdiv_rn(t.acc[c][2 * h + 1], t.l[h]));
    }
    if (lane % 4 == 0) *lse[h] = __fadd_rn(__fmul_rn(t.m[h], kLn2), logf(t.l[h]));
  }
}

// ---- kernels ----------------------------------------------------------------------------------------------------

// One block per (query tile of 64, head); warp w owns rows [16 w, 16 w + 16) of the tile. Key tiles of 64 from the
// document start, double-buffered through cp.async; a warp skips the tiles none of its rows sees (no-ops for them).
template <int HD>
__global__ void __launch_bounds__(kThreads) forward_kernel(bf16* out, float* lse, const bf16* q, const bf16* k,
                                                           const bf16* v, const int32_t* cu, Dims n, bool aligned) {
  constexpr int kStride = HD + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);  // [64][kStride]
  bf16* k_s = q_s + kBlockRows * kStride;         // [2][64][kStride]
  bf16* v_s = k_s + 2 * kKeyTile * kStride;       // [2][64][kStride]
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kBlockRows, &tile)) return;
  const int h = static_cast<int>(blockIdx.y), g = h / n.group;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t q_stride = static_cast<int64_t>(n.nh) * HD, k_stride = static_cast<int64_t>(n.nkv) * HD;
  load_tile<HD>(q_s, q + tile.begin * q_stride + static_cast<int64_t>(h) * HD, q_stride, tile.end - tile.begin,
                kBlockRows, aligned);

  const KeyWalk walk(tile, n, warp);
  const auto load_kv = [&](int it) { walk.load<HD>(it, k_s, v_s, k, v, k_stride, g, aligned); };
  const int num_k = walk.count, w_first = walk.warp_first, w_kb = walk.warp_begin, w_ke = walk.warp_end;
  const bool active = walk.active;
  load_kv(0);
  cp_async_commit();

  int row_kb[2], row_ke[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w_first + lane / 4 + 8 * r;
    row_kb[r] = i < tile.end ? key_begin(i, tile.doc_begin, n) : 0;
    row_ke[r] = i < tile.end ? key_end(i, tile.doc_end, n) : 0;
  }
  RowTile<HD> t;
  init_rows(t);

  for (int it = 0; it < num_k; ++it) {
    if (it + 1 < num_k) load_kv(it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = walk.first + it * kKeyTile;
    if (active && k0 < w_ke && k0 + kKeyTile > w_kb) {
      const int buf = it % 2;
      forward_tile<HD>(t, q_s + warp * kWarpRows * kStride, k_s + buf * kKeyTile * kStride,
                       v_s + buf * kKeyTile * kStride, k0, row_kb, row_ke, n.scale_log2, lane);
    }
    __syncthreads();  // the tile's buffer is free for the load two steps on
  }

  bf16* out_row[2];
  float* lse_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w_first + lane / 4 + 8 * r;
    const int64_t pair = static_cast<int64_t>(i) * n.nh + h;
    out_row[r] = i < tile.end ? out + pair * HD : nullptr;
    lse_row[r] = lse + (i < tile.end ? pair : 0);
  }
  write_rows(t, out_row, lse_row, lane);
}

// Decoding: one block (one warp) per (sequence b, kv head g, chunk of 16 of its query heads), the heads in the rows
// of one mma tile, all at position i = lengths[b] - 1 of a document starting at cache row 0. The key tiles are the
// forward's (64, aligned at 0) from the one holding the row's first visible key to the one holding i: the forward's
// earlier tiles are no-ops for the row. Cache rows past i are not read (zero in shared memory).
template <int HD>
__global__ void __launch_bounds__(32) decode_kernel(bf16* out, float* lse, const bf16* q, const bf16* k_cache,
                                                    const bf16* v_cache, const int32_t* lengths, int nh, int nkv,
                                                    int64_t capacity, float scale_log2, int window, bool aligned) {
  constexpr int kStride = HD + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);  // [16][kStride]
  bf16* k_s = q_s + kWarpRows * kStride;          // [64][kStride]
  bf16* v_s = k_s + kKeyTile * kStride;           // [64][kStride]
  const int64_t b = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y), group = nh / nkv;
  const int h0 = g * group + static_cast<int>(blockIdx.z) * kWarpRows;
  const int count = min(kWarpRows, g * group + group - h0);
  const int lane = static_cast<int>(threadIdx.x);
  const int i = lengths[b] - 1;
  const int kb = window > 0 ? max(0, i - window + 1) : 0, ke = i + 1;
  load_tile<HD>(q_s, q + (b * nh + h0) * HD, HD, count, kWarpRows, aligned);
  const int64_t k_stride = static_cast<int64_t>(nkv) * HD;
  const bf16* k_base = k_cache + b * capacity * k_stride + static_cast<int64_t>(g) * HD;
  const bf16* v_base = v_cache + b * capacity * k_stride + static_cast<int64_t>(g) * HD;
  const int row_kb[2] = {kb, kb}, row_ke[2] = {ke, ke};
  RowTile<HD> t;
  init_rows(t);
  for (int k0 = kb / kKeyTile * kKeyTile; k0 < ke; k0 += kKeyTile) {
    const int nk = min(kKeyTile, ke - k0);
    __syncthreads();  // the previous tile's reads are done
    load_tile<HD>(k_s, k_base + k0 * k_stride, k_stride, nk, kKeyTile, aligned);
    load_tile<HD>(v_s, v_base + k0 * k_stride, k_stride, nk, kKeyTile, aligned);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    forward_tile<HD>(t, q_s, k_s, v_s, k0, row_kb, row_ke, scale_log2, lane);
  }
  bf16* out_row[2];
  float* lse_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    const int64_t pair = b * nh + h0 + row;
    out_row[r] = row < count ? out + pair * HD : nullptr;
    lse_row[r] = lse + (row < count ? pair : 0);
  }
  write_rows(t, out_row, lse_row, lane);
}

// row_term[i, h] = dot(dout[i, h], out[i, h]) in f32, one warp per (token, head), lanes' partial sums over columns
// lane + 32 c then a butterfly.
__global__ void __launch_bounds__(256)
    row_term_kernel(float* row_term, const bf16* dout, const bf16* out, int64_t pairs, int hdv) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (pair >= pairs) return;
  float s = 0.0f;
  for (int c = lane; c < hdv; c += 32) {
    s = __fmaf_rn(__bfloat162float(dout[pair * hdv + c]), __bfloat162float(out[pair * hdv + c]), s);
  }
  for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
  if (lane == 0) row_term[pair] = s;
}

// dq_i = scale sum_j p_ij (dp_ij - D_i) k_j, p_ij = 2^(s_ij scale log2(e) - lse_i log2(e)), dp_ij = dout_i . v_j.
// One block per (query tile of 64, head), the forward's layout and key tiles.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse,
              const float* row_term, const int32_t* cu, Dims n, bool aligned) {
  constexpr int kStride = HD + kPad, kN = kKeyTile / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);  // [64][kStride]
  bf16* do_s = q_s + kBlockRows * kStride;        // [64][kStride]
  bf16* k_s = do_s + kBlockRows * kStride;        // [2][64][kStride]
  bf16* v_s = k_s + 2 * kKeyTile * kStride;       // [2][64][kStride]
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kBlockRows, &tile)) return;
  const int h = static_cast<int>(blockIdx.y), g = h / n.group;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t q_stride = static_cast<int64_t>(n.nh) * HD, k_stride = static_cast<int64_t>(n.nkv) * HD;
  const int rows = tile.end - tile.begin;
  load_tile<HD>(q_s, q + tile.begin * q_stride + static_cast<int64_t>(h) * HD, q_stride, rows, kBlockRows, aligned);
  load_tile<HD>(do_s, dout + tile.begin * q_stride + static_cast<int64_t>(h) * HD, q_stride, rows, kBlockRows, aligned);

  const KeyWalk walk(tile, n, warp);
  const auto load_kv = [&](int it) { walk.load<HD>(it, k_s, v_s, k, v, k_stride, g, aligned); };
  const int num_k = walk.count, w_first = walk.warp_first, w_kb = walk.warp_begin, w_ke = walk.warp_end;
  const bool active = walk.active;
  load_kv(0);
  cp_async_commit();

  int row_kb[2], row_ke[2];
  float row_lse[2], row_d[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w_first + lane / 4 + 8 * r;
    const bool valid = i < tile.end;
    const int64_t pair = static_cast<int64_t>(valid ? i : tile.begin) * n.nh + h;
    row_kb[r] = valid ? key_begin(i, tile.doc_begin, n) : 0;
    row_ke[r] = valid ? key_end(i, tile.doc_end, n) : 0;
    row_lse[r] = __fmul_rn(lse[pair], kLog2e);
    row_d[r] = row_term[pair];
  }
  float acc[HD / 8][4];
#pragma unroll
  for (int c = 0; c < HD / 8; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[c][e] = 0.0f;
  }

  for (int it = 0; it < num_k; ++it) {
    if (it + 1 < num_k) load_kv(it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = walk.first + it * kKeyTile;
    if (active && k0 < w_ke && k0 + kKeyTile > w_kb) {
      const bf16* kt = k_s + (it % 2) * kKeyTile * kStride;
      const bf16* vt = v_s + (it % 2) * kKeyTile * kStride;
      float s[kN][4], dp[kN][4];
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[c][e] = dp[c][e] = 0.0f;
      }
      gemm_abt<kKeyTile, HD>(s, q_s + warp * kWarpRows * kStride, kStride, kt, kStride, lane);
      gemm_abt<kKeyTile, HD>(dp, do_s + warp * kWarpRows * kStride, kStride, vt, kStride, lane);
      const int col0 = k0 + 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, j = col0 + 8 * c + e % 2;
          const float p = (j >= row_kb[r] && j < row_ke[r]) ? ex2(__fmaf_rn(s[c][e], n.scale_log2, -row_lse[r])) : 0.0f;
          s[c][e] = __fmul_rn(p, __fsub_rn(dp[c][e], row_d[r]));
        }
      }
      gemm_pb<HD, kKeyTile>(acc, s, kt, kStride, lane);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w_first + lane / 4 + 8 * r;
    if (i >= tile.end) continue;
    bf16* row = dq + (static_cast<int64_t>(i) * n.nh + h) * HD;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      const int col = 8 * c + 2 * (lane % 4);
      row[col] = __float2bfloat16_rn(__fmul_rn(acc[c][2 * r], n.scale));
      row[col + 1] = __float2bfloat16_rn(__fmul_rn(acc[c][2 * r + 1], n.scale));
    }
  }
}

// dv_j = sum_{h, i} p_ij dout_i and dk_j = scale sum_{h, i} p_ij (dp_ij - D_i) q_i over the query heads h of kv
// head g (ascending) and the query tiles of kQTile from the key tile's first query (ascending). One block per (key
// tile of 64, kv head); warp w owns keys [16 w, 16 w + 16) of the tile and computes the transposed products
// (keys as rows) so that dk / dv accumulate in its registers.
template <int HD, int kQTile>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse,
                const float* row_term, const int32_t* cu, Dims n, bool aligned) {
  constexpr int kStride = HD + kPad, kN = kQTile / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);                         // [64][kStride]
  bf16* v_s = k_s + kBlockRows * kStride;                                // [64][kStride]
  bf16* q_s = v_s + kBlockRows * kStride;                                // [2][kQTile][kStride]
  bf16* do_s = q_s + 2 * kQTile * kStride;                               // [2][kQTile][kStride]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kQTile * kStride);  // [2][kQTile], base-2
  float* d_s = lse_s + 2 * kQTile;                                       // [2][kQTile]
  Tile tile;
  if (!find_tile(cu, n.num_docs, static_cast<int>(blockIdx.x), kBlockRows, &tile)) return;
  const int g = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t q_stride = static_cast<int64_t>(n.nh) * HD, k_stride = static_cast<int64_t>(n.nkv) * HD;
  const int rows = tile.end - tile.begin;
  load_tile<HD>(k_s, k + tile.begin * k_stride + static_cast<int64_t>(g) * HD, k_stride, rows, kBlockRows, aligned);
  load_tile<HD>(v_s, v + tile.begin * k_stride + static_cast<int64_t>(g) * HD, k_stride, rows, kBlockRows, aligned);

  const int qb = query_begin(tile.begin, tile.doc_begin, n), qe = query_end(tile.end - 1, tile.doc_end, n);
  const int num_q = (qe - qb + kQTile - 1) / kQTile, num_it = num_q * n.group;
  const auto load_q = [&](int it) {
    const int h = g * n.group + it / num_q, i0 = qb + (it % num_q) * kQTile, nq = min(kQTile, qe - i0);
    const int buf = it % 2;
    const int64_t head = static_cast<int64_t>(i0) * n.nh + h;
    load_tile<HD>(q_s + buf * kQTile * kStride, q + head * HD, q_stride, nq, kQTile, aligned);
    load_tile<HD>(do_s + buf * kQTile * kStride, dout + head * HD, q_stride, nq, kQTile, aligned);
    for (int t = static_cast<int>(threadIdx.x); t < kQTile; t += kThreads) {
      lse_s[buf * kQTile + t] = t < nq ? __fmul_rn(lse[head + static_cast<int64_t>(t) * n.nh], kLog2e) : 0.0f;
      d_s[buf * kQTile + t] = t < nq ? row_term[head + static_cast<int64_t>(t) * n.nh] : 0.0f;
    }
  };
  load_q(0);
  cp_async_commit();

  const int w_first = tile.begin + warp * kWarpRows, w_last = min(w_first + kWarpRows, tile.end) - 1;
  const bool active = w_first < tile.end;
  const int w_qb = active ? query_begin(w_first, tile.doc_begin, n) : 0;
  const int w_qe = active ? query_end(w_last, tile.doc_end, n) : 0;
  int row_qb[2], row_qe[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = w_first + lane / 4 + 8 * r;
    row_qb[r] = j < tile.end ? query_begin(j, tile.doc_begin, n) : 0;
    row_qe[r] = j < tile.end ? query_end(j, tile.doc_end, n) : 0;
  }
  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
#pragma unroll
  for (int c = 0; c < HD / 8; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[c][e] = dv_acc[c][e] = 0.0f;
  }

  for (int it = 0; it < num_it; ++it) {
    if (it + 1 < num_it) load_q(it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int i0 = qb + (it % num_q) * kQTile;
    if (active && i0 < w_qe && i0 + kQTile > w_qb) {
      const int buf = it % 2;
      const bf16* qt = q_s + buf * kQTile * kStride;
      const bf16* dot = do_s + buf * kQTile * kStride;
      float s[kN][4];
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[c][e] = 0.0f;
      }
      gemm_abt<kQTile, HD>(s, k_s + warp * kWarpRows * kStride, kStride, qt, kStride, lane);
      const int col0 = 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, col = col0 + 8 * c + e % 2, i = i0 + col;
          s[c][e] = (i >= row_qb[r] && i < row_qe[r])
                        ? ex2(__fmaf_rn(s[c][e], n.scale_log2, -lse_s[buf * kQTile + col]))
                        : 0.0f;
        }
      }
      gemm_pb<HD, kQTile>(dv_acc, s, dot, kStride, lane);
      float dp[kN][4];
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[c][e] = 0.0f;
      }
      gemm_abt<kQTile, HD>(dp, v_s + warp * kWarpRows * kStride, kStride, dot, kStride, lane);
#pragma unroll
      for (int c = 0; c < kN; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = col0 + 8 * c + e % 2;
          s[c][e] = __fmul_rn(s[c][e], __fsub_rn(dp[c][e], d_s[buf * kQTile + col]));
        }
      }
      gemm_pb<HD, kQTile>(dk_acc, s, qt, kStride, lane);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = w_first + lane / 4 + 8 * r;
    if (j >= tile.end) continue;
    const int64_t pair = static_cast<int64_t>(j) * n.nkv + g;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      const int col = 8 * c + 2 * (lane % 4);
      dk[pair * HD + col] = __float2bfloat16_rn(__fmul_rn(dk_acc[c][2 * r], n.scale));
      dk[pair * HD + col + 1] = __float2bfloat16_rn(__fmul_rn(dk_acc[c][2 * r + 1], n.scale));
      dv[pair * HD + col] = __float2bfloat16_rn(dv_acc[c][2 * r]);
      dv[pair * HD + col + 1] = __float2bfloat16_rn(dv_acc[c][2 * r + 1]);
    }
  }
}

// ---- launchers --------------------------------------------------------------------------------------------------

// The query tile of dk / dv: 32 rows keep dk, dv, the scores and dp within the registers (64 spills at hd 64).
template <int HD>
constexpr int kDkdvQTile = 32;

template <int HD>
constexpr size_t forward_smem() {
  return sizeof(bf16) * (kBlockRows + 4 * kKeyTile) * (HD + kPad);
}
template <int HD>
constexpr size_t dq_smem() {
  return sizeof(bf16) * (2 * kBlockRows + 4 * kKeyTile) * (HD + kPad);
}
template <int HD>
constexpr size_t dkdv_smem() {
  return sizeof(bf16) * (2 * kBlockRows + 4 * kDkdvQTile<HD>)*(HD + kPad) + sizeof(float) * 4 * kDkdvQTile<HD>;
}
template <int HD>
constexpr size_t decode_smem() {
  return sizeof(bf16) * (kWarpRows + 2 * kKeyTile) * (HD + kPad);
}

// softmax_scale in base 2, computed in one place for the forward and the decoding step.
float scale_log2_of(float scale) { return scale * kLog2e; }

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const AttentionParams& params) {
  const int64_t tokens = q.size(0);
  Dims n{};
  n.tokens = static_cast<int>(tokens);
  n.nh = static_cast<int>(q.size(1));
  n.nkv = static_cast<int>(k.size(1));
  n.group = n.nh / n.nkv;
  n.num_docs = static_cast<int>(cu_seqlens.numel() - 1);
  n.scale = params.softmax_scale;
  n.scale_log2 = scale_log2_of(params.softmax_scale);
  n.causal = params.causal;
  n.window = params.sliding_window >= tokens ? 0 : params.sliding_window;
  return n;
}

bool aligned16(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->raw_data()) % 16 != 0) return false;
  }
  return true;
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

unsigned num_tiles(const Dims& n) { return static_cast<unsigned>(n.tokens / kBlockRows + n.num_docs); }

template <int HD>
void forward_hd(cudaStream_t s, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& cu, const Dims& n) {
  constexpr size_t smem = forward_smem<HD>();
  allow_smem(forward_kernel<HD>, smem);
  const bool aligned = aligned16({&q, &k, &v});
  forward_kernel<HD><<<dim3(num_tiles(n), static_cast<unsigned>(n.nh)), kThreads, smem, s>>>(
      ptr<bf16>(out), ptr<float>(lse), ptr<const bf16>(q), ptr<const bf16>(k), ptr<const bf16>(v),
      ptr<const int32_t>(cu), n, aligned);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <int HD>
void backward_hd(cudaStream_t s, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                 const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                 const Tensor& cu, const Dims& n) {
  const Tensor row_term = Tensor::empty({n.tokens, n.nh}, DType::F32, q.device());
  const int64_t pairs = static_cast<int64_t>(n.tokens) * n.nh;
  row_term_kernel<<<static_cast<unsigned>((pairs + 7) / 8), 256, 0, s>>>(ptr<float>(row_term), ptr<const bf16>(dout),
                                                                         ptr<const bf16>(out), pairs, HD);
  MT_CUDA_CHECK(cudaGetLastError());
  const bool aligned = aligned16({&q, &k, &v, &dout});

  constexpr size_t dq_bytes = dq_smem<HD>();
  allow_smem(dq_kernel<HD>, dq_bytes);
  dq_kernel<HD><<<dim3(num_tiles(n), static_cast<unsigned>(n.nh)), kThreads, dq_bytes, s>>>(
      ptr<bf16>(dq), ptr<const bf16>(dout), ptr<const bf16>(q), ptr<const bf16>(k), ptr<const bf16>(v),
      ptr<const float>(lse), ptr<const float>(row_term), ptr<const int32_t>(cu), n, aligned);
  MT_CUDA_CHECK(cudaGetLastError());

  constexpr size_t dkdv_bytes = dkdv_smem<HD>();
  allow_smem(dkdv_kernel<HD, kDkdvQTile<HD>>, dkdv_bytes);
  dkdv_kernel<HD, kDkdvQTile<HD>><<<dim3(num_tiles(n), static_cast<unsigned>(n.nkv)), kThreads, dkdv_bytes, s>>>(
      ptr<bf16>(dk), ptr<bf16>(dv), ptr<const bf16>(dout), ptr<const bf16>(q), ptr<const bf16>(k), ptr<const bf16>(v),
      ptr<const float>(lse), ptr<const float>(row_term), ptr<const int32_t>(cu), n, aligned);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <int HD>
void decode_hd(cudaStream_t s, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache,
               const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params) {
  const int64_t batch = q.size(0), nh = q.size(1), nkv = k_cache.size(2);
  const int64_t chunks = (nh / nkv + kWarpRows - 1) / kWarpRows;
  constexpr size_t smem = decode_smem<HD>();
  allow_smem(decode_kernel<HD>, smem);
  const bool aligned = aligned16({&q, &k_cache, &v_cache});
  decode_kernel<HD>
      <<<dim3(static_cast<unsigned>(batch), static_cast<unsigned>(nkv), static_cast<unsigned>(chunks)), 32, smem, s>>>(
          ptr<bf16>(out), ptr<float>(lse), ptr<const bf16>(q), ptr<const bf16>(k_cache), ptr<const bf16>(v_cache),
          ptr<const int32_t>(lengths), static_cast<int>(nh), static_cast<int>(nkv), k_cache.size(1),
          scale_log2_of(params.softmax_scale), params.sliding_window, aligned);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool mma_attention_supported(DType dtype, int64_t hd, int64_t hdv) {
  return dtype == DType::BF16 && hd == hdv && (hd == 64 || hd == 128);
}

void mma_attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params) {
  MT_CHECK(mma_attention_supported(q.dtype(), q.size(2), v.size(2)),
           "mma_attention_forward: expected bf16 with hd == hdv, 64 or 128, but found {} and hdv = {}", q.describe(),
           v.size(2));
  const Dims n = dims_of(q, k, cu_seqlens, params);
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  q.size(2) == 64 ? forward_hd<64>(s, out, lse, q, k, v, cu_seqlens, n)
                  : forward_hd<128>(s, out, lse, q, k, v, cu_seqlens, n);
}

void mma_attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& lse, const Tensor& cu_seqlens, const AttentionParams& params) {
  MT_CHECK(mma_attention_supported(q.dtype(), q.size(2), v.size(2)),
           "mma_attention_backward: expected bf16 with hd == hdv, 64 or 128, but found {} and hdv = {}", q.describe(),
           v.size(2));
  const Dims n = dims_of(q, k, cu_seqlens, params);
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  q.size(2) == 64 ? backward_hd<64>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n)
                  : backward_hd<128>(s, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n);
}

void mma_attention_decode_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                                  const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                                  const AttentionParams& params) {
  MT_CHECK(mma_attention_supported(q.dtype(), q.size(2), v_cache.size(3)),
           "mma_attention_decode_forward: expected bf16 with hd == hdv, 64 or 128, but found {} and hdv = {}",
           q.describe(), v_cache.size(3));
  const auto s = static_cast<cudaStream_t>(stream_handle(stream));
  q.size(2) == 64 ? decode_hd<64>(s, out, lse, q, k_cache, v_cache, lengths, params)
                  : decode_hd<128>(s, out, lse, q, k_cache, v_cache, lengths, params);
}

}  // namespace moetrain::ops::cuda
