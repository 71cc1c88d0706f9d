// defines: the chunked gated delta rule kernels (ops/cuda/gated_delta_chunked.h): a chunk table over the packed
// documents, the per-chunk WY preparation (A, its inverse by forward substitution, w, u), the forward state pass,
// the output, and for the backward the local dU, the reverse state pass and the per-chunk gradients. Every matrix
// product is one block's f32 shared-memory tiled product (block_gemm) with sums in ascending k; row sums run in fixed
// orders: deterministic, no float atomics.
#include "ops/cuda/gated_delta_chunked.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/async_copy.cuh"
#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/gated_delta.h"
#include "ops/cuda/gated_delta_common.cuh"
#include "ops/cuda/runtime.h"
#include "ops/op_profile.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kChunk = static_cast<int>(kGdnChunk);  // tokens per chunk (64)
constexpr int kThreads = 256;                        // every kernel: 16 x 16 threads
constexpr int kWarps = kThreads / 32;
constexpr int kLd = kChunk + 1;                     // row stride of the chunk x chunk shared matrices
constexpr int kSquare = kChunk * kLd;               // floats of one of them
constexpr int kStep = 16;                           // values of k per block_gemm stage
constexpr int kStageFloats = 2 * kStep * (64 + 1);  // block_gemm's staging for tiles up to 64 x 64
constexpr int kColTile = 32;                        // value columns per block of the state passes
constexpr int kMaxDim = 128;                        // dk, dv
constexpr int kGateFloats = 4 * kChunk;             // gc, beta, G, F

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

struct Dims {
  int64_t tokens, docs, slots;
  int hk, hv, dk, dv, group;
  float scale;
};

// Element offsets of token t's row: q / k of key head kh, v / out / u / U of value head h, w / per-head dq, dk of h.
__device__ __forceinline__ int64_t key_row(const Dims& d, int64_t t, int kh) { return (t * d.hk + kh) * d.dk; }
__device__ __forceinline__ int64_t value_row(const Dims& d, int64_t t, int h) { return (t * d.hv + h) * d.dv; }
__device__ __forceinline__ int64_t head_key_row(const Dims& d, int64_t t, int h) { return (t * d.hv + h) * d.dk; }
// A [dk, dv] state of chunk slot `slot`, value head h.
__device__ __forceinline__ int64_t state_at(const Dims& d, int64_t slot, int h) {
  return (slot * d.hv + h) * int64_t(d.dk) * d.dv;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// epilogue(m, n, sum_k a(m, k) b(k, n)) for m < M, n < N, the sum over k < K in ascending k, by the block's 16 x 16
// threads, each holding RM x RN outputs (rows ty + 16 r, columns tx + 16 c) of a (16 RM) x (16 RN) tile; kStep
// values of k at a time go through `stage` (shared, kStageFloats). A_KFAST: a's consecutive k lie next to each other
// in memory (so the staging loads walk k), else consecutive m; B_NFAST: b's consecutive n, else consecutive k. Every
// thread of the block calls it with the same M, N, K; it ends with a barrier, so the epilogue's writes are visible to
// the block after it. Inputs and outputs must not overlap.
template <int RM, int RN, bool A_KFAST, bool B_NFAST, bool PREFETCH = true, class FA, class FB, class FE>
__device__ void block_gemm(int M, int N, int K, FA a, FB b, FE epilogue, float* stage) {
  constexpr int TM = 16 * RM, TN = 16 * RN;
  // Elements of a and b each thread stages per step. With PREFETCH they are read into registers one step ahead, so
  // the loads of step k0 + kStep are in flight while the block multiplies step k0 out of shared memory; without, each
  // step reads its own (fewer live registers: kernels whose occupancy hides the latency better, as prepare's).
  constexpr int kAPerThread = (kStep * TM + kThreads - 1) / kThreads,
                kBPerThread = (kStep * TN + kThreads - 1) / kThreads;
  static_assert(kStep * (TM + 1 + TN + 1) <= kStageFloats, "block_gemm: staging too small");
  float* as = stage;                     // [kStep][TM + 1]
  float* bs = stage + kStep * (TM + 1);  // [kStep][TN + 1]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  for (int m0 = 0; m0 < M; m0 += TM) {
    for (int n0 = 0; n0 < N; n0 += TN) {
      float a_next[kAPerThread], b_next[kBPerThread];
      const auto fetch = [&](int k0) {
#pragma unroll
        for (int p = 0; p < kAPerThread; ++p) {
          const int e = tid + p * kThreads;
          const int kk = A_KFAST ? e % kStep : e / TM, mm = A_KFAST ? e / kStep : e % TM;
          const int m = m0 + mm, k = k0 + kk;
          a_next[p] = (e < kStep * TM && m < M && k < K) ? a(m, k) : 0.0f;
        }
#pragma unroll
        for (int p = 0; p < kBPerThread; ++p) {
          const int e = tid + p * kThreads;
          const int kk = B_NFAST ? e / TN : e % kStep, nn = B_NFAST ? e % TN : e / kStep;
          const int n = n0 + nn, k = k0 + kk;
          b_next[p] = (e < kStep * TN && n < N && k < K) ? b(k, n) : 0.0f;
        }
      };
      float acc[RM][RN];
#pragma unroll
      for (int r = 0; r < RM; ++r) {
#pragma unroll
        for (int c = 0; c < RN; ++c) acc[r][c] = 0.0f;
      }
      if constexpr (PREFETCH) fetch(0);
      for (int k0 = 0; k0 < K; k0 += kStep) {
        if constexpr (!PREFETCH) fetch(k0);
#pragma unroll
        for (int p = 0; p < kAPerThread; ++p) {
          const int e = tid + p * kThreads;
          const int kk = A_KFAST ? e % kStep : e / TM, mm = A_KFAST ? e / kStep : e % TM;
          if (e < kStep * TM) as[kk * (TM + 1) + mm] = a_next[p];
        }
#pragma unroll
        for (int p = 0; p < kBPerThread; ++p) {
          const int e = tid + p * kThreads;
          const int kk = B_NFAST ? e / TN : e % kStep, nn = B_NFAST ? e % TN : e / kStep;
          if (e < kStep * TN) bs[kk * (TN + 1) + nn] = b_next[p];
        }
        __syncthreads();
        if (PREFETCH && k0 + kStep < K) fetch(k0 + kStep);
#pragma unroll
        for (int kk = 0; kk < kStep; ++kk) {
          float ar[RM], br[RN];
#pragma unroll
          for (int r = 0; r < RM; ++r) ar[r] = as[kk * (TM + 1) + ty + 16 * r];
#pragma unroll
          for (int c = 0; c < RN; ++c) br[c] = bs[kk * (TN + 1) + tx + 16 * c];
#pragma unroll
          for (int r = 0; r < RM; ++r) {
#pragma unroll
            for (int c = 0; c < RN; ++c) acc[r][c] += ar[r] * br[c];
          }
        }
        __syncthreads();
      }
#pragma unroll
      for (int r = 0; r < RM; ++r) {
#pragma unroll
        for (int c = 0; c < RN; ++c) {
          const int m = m0 + ty + 16 * r, n = n0 + tx + 16 * c;
          if (m < M && n < N) epilogue(m, n, acc[r][c]);
        }
      }
    }
  }
  __syncthreads();
}

// row(i, s) for i < rows with s = sum_{e < n} f(i, e): one warp per row, lane-strided then butterflies.
template <class F, class R>
__device__ void row_sums(int rows, int n, F f, R row) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < rows; i += kWarps) {
    float s = 0.0f;
    for (int e = lane; e < n; e += 32) s += f(i, e);
    s = warp_sum(s);
    if (lane == 0) row(i, s);
  }
  __syncthreads();
}

// The chunk's cumulative log-decay by warp 0, from the raw gates raw[i * raw_stride], i < len: gc (the sum from
// the chunk's start, its own token included; skipped when gc is null), G = exp(gc), F = exp(gc_last - gc). A scan over
// lanes of two tokens each, in a fixed order. The caller's barrier makes them visible.
__device__ void scan_chunk_gates(float* gc, float* G, float* F, const float* raw, int len, int64_t raw_stride = 1) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x, i0 = 2 * lane, i1 = i0 + 1;
  const float a = i0 < len ? raw[i0 * raw_stride] : 0.0f, b = i1 < len ? raw[i1 * raw_stride] : 0.0f;
  float inclusive = a + b;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float before = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += before;
  }
  const float exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  const float g0 = (lane == 0 ? 0.0f : exclusive) + a, g1 = g0 + b;
  const float g_last = __shfl_sync(0xffffffffu, ((len - 1) & 1) ? g1 : g0, (len - 1) / 2);
  if (i0 < len) {
    if (gc != nullptr) gc[i0] = g0;
    G[i0] = expf(g0);
    F[i0] = expf(g_last - g0);
  }
  if (i1 < len) {
    if (gc != nullptr) gc[i1] = g1;
    G[i1] = expf(g1);
    F[i1] = expf(g_last - g1);
  }
}

// The chunk's gates in shared memory: gc, beta (unless null), G, F (scan_chunk_gates). Ends with a barrier.
__device__ void load_gates(float* gates, const float* g, const float* beta, int64_t t0, int len, int h, int hv) {
  float *gc = gates, *bt = gates + kChunk, *G = bt + kChunk, *F = G + kChunk;
  scan_chunk_gates(gc, G, F, g + t0 * hv + h, len, hv);
  if (beta != nullptr) {
    for (int i = threadIdx.x; i < len; i += kThreads) bt[i] = beta[(t0 + i) * hv + h];
  }
  __syncthreads();
}

// Chunk slots: chunk c of document d is slot cu[d] / kChunk + d + c, disjoint between documents and below
// T / kChunk + D (floor(b / 64) + ceil((e - b) / 64) <= floor(e / 64) + 1). start[slot] its first token, len[slot]
// its tokens (0: a slot no chunk uses; the caller zeroes len).
__global__ void chunk_table_kernel(int32_t* start, int32_t* len, const int32_t* cu, int64_t docs) {
  for (int64_t doc = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; doc < docs;
       doc += int64_t(gridDim.x) * blockDim.x) {
    const int64_t begin = cu[doc], end = cu[doc + 1], base = begin / kChunk + doc;
    for (int64_t c = 0; begin + c * kChunk < end; ++c) {
      start[base + c] = static_cast<int32_t>(begin + c * kChunk);
      len[base + c] = static_cast<int32_t>(end - begin - c * kChunk < kChunk ? end - begin - c * kChunk : kChunk);
    }
  }
}

// Per (chunk slot, value head): A, Tm = (I + A)^-1, w = Tm diag(beta G) K, u = Tm diag(beta) V; Tm kept when tmat is
// not null ([slots, Hv, 64, 64]).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    prepare_kernel(float* w, float* u, float* tmat, const T* k, const T* v, const float* g, const float* beta,
                   const int32_t* chunk_start, const int32_t* chunk_len, Dims d) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, len = chunk_len[slot];
  if (len == 0) return;
  const int64_t t0 = chunk_start[slot];
  extern __shared__ float smem[];
  float* gates = smem;
  const float *gc = gates, *bt = gates + kChunk, *G = bt + kChunk;
  float* a = gates + kGateFloats;  // [kChunk][kLd]
  float* tm = a + kSquare;         // [kChunk][kLd]
  float* stage = tm + kSquare;
  load_gates(gates, g, beta, t0, len, h, d.hv);
  const T* kc = k + key_row(d, t0, kh);
  const T* vc = v + value_row(d, t0, h);
  const int64_t kstride = int64_t(d.hk) * d.dk, vstride = int64_t(d.hv) * d.dv;
  block_gemm<4, 4, true, false, false>(
      len, len, d.dk, [&](int i, int e) { return load_float(kc + i * kstride + e); },
      [&](int e, int j) { return load_float(kc + j * kstride + e); },
      [&](int i, int j, float s) { a[i * kLd + j] = j < i ? bt[i] * s * expf(gc[i] - gc[j]) : 0.0f; }, stage);
  // Column c of Tm by forward substitution down the rows: Tm_ic = [i == c] - sum_{c <= j < i} A_ij Tm_jc.
  for (int c = threadIdx.x; c < len; c += kThreads) {
    for (int i = 0; i < len; ++i) {
      float s = i == c ? 1.0f : 0.0f;
      if (i > c) {
        float sum = 0.0f;
        for (int j = c; j < i; ++j) sum += a[i * kLd + j] * tm[j * kLd + c];
        s = -sum;
      }
      tm[i * kLd + c] = s;
    }
  }
  __syncthreads();
  const auto tm_at = [&](int i, int j) { return tm[i * kLd + j]; };
  block_gemm<4, 4, true, true, false>(
      len, d.dk, len, tm_at, [&](int j, int e) { return bt[j] * G[j] * load_float(kc + j * kstride + e); },
      [&](int i, int e, float s) { w[head_key_row(d, t0 + i, h) + e] = s; }, stage);
  block_gemm<4, 4, true, true, false>(
      len, d.dv, len, tm_at, [&](int j, int e) { return bt[j] * load_float(vc + j * vstride + e); },
      [&](int i, int e, float s) { u[value_row(d, t0 + i, h) + e] = s; }, stage);
  if (tmat != nullptr) {
    float* dst = tmat + (slot * d.hv + h) * kChunk * kChunk;
    for (int e = threadIdx.x; e < len * kChunk; e += kThreads) {
      const int i = e / kChunk, j = e % kChunk;
      dst[e] = j < len ? tm[i * kLd + j] : 0.0f;
    }
  }
}

// The state passes (state_forward_kernel, state_backward_kernel) walk a document's chunks in order, so their time is
// the latency of one chunk times the chunks. Each stages the operands of the chunks ahead in shared memory by
// asynchronous copies (kStages buffers) while it computes on the current one, and every product reads shared memory
// only: a thread owns a 4 x 2 block of the chunk's rows (U, dU) and an 8 x 2 block of the state (S, dS), which it
// also keeps in registers. Staged rows of width dk are padded to a multiple of 8 (zeros) for 16-byte reads.
__host__ __device__ constexpr int staged_width(int dk) { return (dk + 7) / 8 * 8; }

// floats of one staged chunk: w [kChunk][ks] f32, u (forward) or du (backward) [kChunk][kColTile] f32, the raw
// gates [kChunk], then T rows: k (and q in the backward) [kChunk][ks], and dO [kChunk][kColTile] in the backward.
template <typename T>
__host__ __device__ constexpr int64_t staged_chunk_floats(int ks, bool backward) {
  const int64_t t_elems = int64_t(kChunk) * ks * (backward ? 2 : 1) + (backward ? kChunk * kColTile : 0);
  return int64_t(kChunk) * ks + kChunk * kColTile + kChunk + t_elems * int64_t(sizeof(T)) / 4;
}

// floats before the staged chunks: G, F, the state [kMaxDim][kColTile], one or two [kChunk][kColTile] row blocks.
constexpr int64_t state_pass_fixed_floats(bool backward) {
  return 2 * kChunk + kMaxDim * kColTile + (backward ? 2 : 1) * kChunk * kColTile;
}

template <typename T>
size_t state_pass_shared(int dk, bool backward, int stages) {
  return sizeof(float) *
         (state_pass_fixed_floats(backward) + stages * staged_chunk_floats<T>(staged_width(dk), backward));
}

// Four and eight consecutive elements of a staged row as floats (16-byte aligned for eight, 8 or 16 for four).
__device__ __forceinline__ void load_row4(const float* p, float* out) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void load_row4(const __nv_bfloat16* p, float* out) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&x);
  const float2 a = __bfloat1622float2(pair[0]), b = __bfloat1622float2(pair[1]);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
template <typename E>
__device__ __forceinline__ void load_row8(const E* p, float* out) {
  load8(p, *reinterpret_cast<float(*)[8]>(out));
}

// acc[r][c] += sum_e a[(row0 + r) * ks + e] b[e * kColTile + col0 + c] for r < 4, c < 2, e < ks: a thread's 4 x 2
// block of a [kChunk][ks] x [ks][kColTile] product, both operands in shared memory.
template <typename E>
__device__ __forceinline__ void rows_times_state(float (&acc)[4][2], const E* a, int ks, const float* b, int row0,
                                                 int col0) {
  for (int e = 0; e < ks; e += 4) {
    float2 bv[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) bv[q] = *reinterpret_cast<const float2*>(b + (e + q) * kColTile + col0);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float av[4];
      load_row4(a + (row0 + r) * ks + e, av);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        acc[r][0] += av[q] * bv[q].x;
        acc[r][1] += av[q] * bv[q].y;
      }
    }
  }
}

// The state passes' shared steps. A thread's 8 x 2 block of the state (rows ty * 8 + r, columns tx * 2 + c) is written
// to the chunk's slot (dst: the slot's first row, column c0 of the tile) for rows < dk and columns < nc.
__device__ __forceinline__ void store_state_block(float* dst, const float (&block)[8][2], int ty, int tx, int dk,
                                                  int dv, int nc) {
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int m = ty * 8 + r, j = tx * 2 + cc;
      if (m < dk && j < nc) dst[int64_t(m) * dv + j] = block[r][cc];
    }
  }
}

// block = last * block + acc, mirrored into the shared state [kMaxDim][kColTile] for the next chunk's products.
__device__ __forceinline__ void decay_and_add(float (&block)[8][2], const float (&acc)[8][2], float last, float* shared,
                                              int ty, int tx) {
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      block[r][cc] = last * block[r][cc] + acc[r][cc];
      shared[(ty * 8 + r) * kColTile + tx * 2 + cc] = block[r][cc];
    }
  }
}

// Before the n-th chunk of a pass: with two buffers, stage chunk n + 1 and wait for chunk n's copies (staged one
// step earlier); with one, stage chunk n and wait for it. Then a barrier makes the copies visible.
template <int kStages, class Stage>
__device__ __forceinline__ void await_chunk(int64_t n, Stage stage_chunk) {
  if constexpr (kStages > 1) {
    stage_chunk(n + 1);
    wait_copies<1>();
  } else {
    stage_chunk(n);
    wait_copies<0>();
  }
  __syncthreads();
}

// Per (document, value head, 32 value columns), chunk after chunk from S = 0: keep S as the chunk's start state,
// U = u - w S, S = G_last S + (diag(F) K)^T U.
template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads)
    state_forward_kernel(float* states, float* big_u, const float* w, const float* u, const T* k, const float* g,
                         const int32_t* cu, Dims d) {
  const int64_t doc = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, c0 = blockIdx.z * kColTile;
  const int nc = d.dv - c0 < kColTile ? d.dv - c0 : kColTile;
  const int ks = staged_width(d.dk);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  extern __shared__ __align__(16) float smem[];
  float *G = smem, *F = G + kChunk;
  float* s = F + kChunk;               // [kMaxDim][kColTile]
  float* su = s + kMaxDim * kColTile;  // [kChunk][kColTile]: F_i U_ij
  float* staged = su + kChunk * kColTile;
  const int64_t chunk_floats = staged_chunk_floats<T>(ks, false);
  const auto w_rows = [&](int64_t b) { return staged + b * chunk_floats; };
  const auto u_rows = [&](int64_t b) { return w_rows(b) + kChunk * ks; };
  const auto g_raw = [&](int64_t b) { return u_rows(b) + kChunk * kColTile; };
  const auto k_rows = [&](int64_t b) { return reinterpret_cast<T*>(g_raw(b) + kChunk); };
  for (int64_t e = threadIdx.x; e < kMaxDim * kColTile + kChunk * kColTile + kStages * chunk_floats; e += kThreads) {
    s[e] = 0.0f;  // the state, and the staged rows' padding
  }
  __syncthreads();
  const int64_t begin = cu[doc], end = cu[doc + 1], base = begin / kChunk + doc;
  const int64_t chunks = (end - begin + kChunk - 1) / kChunk;
  const int64_t kstride = int64_t(d.hk) * d.dk, vstride = int64_t(d.hv) * d.dv, hstride = int64_t(d.hv) * d.dk;
  const auto chunk_len = [&](int64_t c) {
    return static_cast<int>(end - begin - c * kChunk < kChunk ? end - begin - c * kChunk : kChunk);
  };
  const auto stage_chunk = [&](int64_t c) {
    if (c < chunks) {
      const int64_t t0 = begin + c * kChunk, b = c % kStages;
      const int len = chunk_len(c);
      copy_rows_async(w_rows(b), ks, w + head_key_row(d, t0, h), hstride, len, d.dk);
      copy_rows_async(u_rows(b), kColTile, u + value_row(d, t0, h) + c0, vstride, len, nc);
      copy_rows_async(g_raw(b), 1, g + t0 * d.hv + h, d.hv, len, 1);
      copy_rows_async(k_rows(b), ks, k + key_row(d, t0, kh), kstride, len, d.dk);
    }
    commit_copies();
  };
  float state[8][2] = {};
  if (kStages > 1) stage_chunk(0);
  for (int64_t c = 0; c < chunks; ++c) {
    await_chunk<kStages>(c, stage_chunk);
    const int64_t t0 = begin + c * kChunk, slot = base + c, b = c % kStages;
    const int len = chunk_len(c);
    scan_chunk_gates(nullptr, G, F, g_raw(b), len);
    store_state_block(states + state_at(d, slot, h) + c0, state, ty, tx, d.dk, d.dv, nc);
    __syncthreads();
    {
      float acc[4][2] = {};
      if (ty * 4 < len) rows_times_state(acc, w_rows(b), ks, s, ty * 4, tx * 2);
      const float* ub = u_rows(b);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int i = ty * 4 + r, j = tx * 2 + cc;
          if (i >= len) continue;
          float val = 0.0f;
          if (j < nc) {
            val = ub[i * kColTile + j] - acc[r][cc];
            big_u[value_row(d, t0 + i, h) + c0 + j] = val;
          }
          su[i * kColTile + j] = F[i] * val;
        }
      }
    }
    __syncthreads();
    if (ty * 8 < d.dk) {
      const float last = G[len - 1];
      float acc[8][2] = {};
      const T* kb = k_rows(b);
      for (int i = 0; i < len; ++i) {
        float kv[8];
        load_row8(kb + i * ks + ty * 8, kv);
        const float2 uv = *reinterpret_cast<const float2*>(su + i * kColTile + tx * 2);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          acc[r][0] += kv[r] * uv.x;
          acc[r][1] += kv[r] * uv.y;
        }
      }
      decay_and_add(state, acc, last, s, ty, tx);
    }
    __syncthreads();  // the state for the next chunk's U; this chunk's buffer free for the copies ahead
  }
}

// cm[i][j] = (q'_i . k_j) exp(gc_i - gc_j) for j <= i, else 0 (the chunk's causal decayed scores).
template <typename T>
__device__ void decayed_scores(float* cm, const float* gc, const T* qc, const T* kc, int len, const Dims& d,
                               float* stage) {
  const int64_t kstride = int64_t(d.hk) * d.dk;
  block_gemm<4, 4, true, false>(
      len, len, d.dk, [&](int i, int e) { return d.scale * load_float(qc + i * kstride + e); },
      [&](int e, int j) { return load_float(kc + j * kstride + e); },
      [&](int i, int j, float x) { cm[i * kLd + j] = j <= i ? x * expf(gc[i] - gc[j]) : 0.0f; }, stage);
}

// Per (chunk slot, value head): O = diag(G) Q' S + cm U, as one product over [Q' | cm] and [S ; U].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    output_kernel(T* out, const float* states, const float* big_u, const T* q, const T* k, const float* g,
                  const int32_t* chunk_start, const int32_t* chunk_len, Dims d) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, len = chunk_len[slot];
  if (len == 0) return;
  const int64_t t0 = chunk_start[slot];
  extern __shared__ float smem[];
  float* gates = smem;
  const float *gc = gates, *G = gates + 2 * kChunk;
  float* cm = gates + kGateFloats;
  float* stage = cm + kSquare;
  load_gates(gates, g, nullptr, t0, len, h, d.hv);
  const T* qc = q + key_row(d, t0, kh);
  decayed_scores(cm, gc, qc, k + key_row(d, t0, kh), len, d, stage);
  const float* s0 = states + state_at(d, slot, h);
  const int64_t kstride = int64_t(d.hk) * d.dk, vstride = int64_t(d.hv) * d.dv;
  const float* uc = big_u + value_row(d, t0, h);
  T* oc = out + value_row(d, t0, h);
  block_gemm<4, 4, true, true>(
      len, d.dv, d.dk + len,
      [&](int i, int e) {
        return e < d.dk ? G[i] * d.scale * load_float(qc + i * kstride + e) : cm[i * kLd + e - d.dk];
      },
      [&](int e, int n) { return e < d.dk ? s0[e * d.dv + n] : uc[(e - d.dk) * vstride + n]; },
      [&](int i, int n, float x) { store_float(oc + i * vstride + n, x); }, stage);
}

// Per (chunk slot, value head): du = cm^T dO, the gradient of U through the chunk's own outputs.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    local_du_kernel(float* du, const T* dout, const T* q, const T* k, const float* g, const int32_t* chunk_start,
                    const int32_t* chunk_len, Dims d) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, len = chunk_len[slot];
  if (len == 0) return;
  const int64_t t0 = chunk_start[slot];
  extern __shared__ float smem[];
  float* gates = smem;
  float* cm = gates + kGateFloats;
  float* stage = cm + kSquare;
  load_gates(gates, g, nullptr, t0, len, h, d.hv);
  decayed_scores(cm, gates, q + key_row(d, t0, kh), k + key_row(d, t0, kh), len, d, stage);
  const int64_t vstride = int64_t(d.hv) * d.dv;
  const T* dorow = dout + value_row(d, t0, h);
  float* duc = du + value_row(d, t0, h);
  block_gemm<4, 4, false, true>(
      len, d.dv, len, [&](int j, int i) { return cm[i * kLd + j]; },
      [&](int i, int n) { return load_float(dorow + i * vstride + n); },
      [&](int j, int n, float x) { duc[j * vstride + n] = x; }, stage);
}

// Per (document, value head, 32 value columns), chunk after chunk backwards from dS = 0 at the document's end: keep
// dS as the gradient of the chunk's end state, dU = du + diag(F) K dS (completing du in place), then
// dS = G_last dS + Q'^T diag(G) dO - w^T dU.
template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads)
    state_backward_kernel(float* dstates, float* du, const float* w, const T* q, const T* k, const T* dout,
                          const float* g, const int32_t* cu, Dims d) {
  const int64_t doc = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, c0 = blockIdx.z * kColTile;
  const int nc = d.dv - c0 < kColTile ? d.dv - c0 : kColTile;
  const int ks = staged_width(d.dk);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  extern __shared__ __align__(16) float smem[];
  float *G = smem, *F = G + kChunk;
  float* ds = F + kChunk;                // [kMaxDim][kColTile]
  float* sdu = ds + kMaxDim * kColTile;  // [kChunk][kColTile]: dU
  float* sdo = sdu + kChunk * kColTile;  // [kChunk][kColTile]: G_i scale dO_ij
  float* staged = sdo + kChunk * kColTile;
  const int64_t chunk_floats = staged_chunk_floats<T>(ks, true);
  const auto w_rows = [&](int64_t b) { return staged + b * chunk_floats; };
  const auto du_rows = [&](int64_t b) { return w_rows(b) + kChunk * ks; };
  const auto g_raw = [&](int64_t b) { return du_rows(b) + kChunk * kColTile; };
  const auto k_rows = [&](int64_t b) { return reinterpret_cast<T*>(g_raw(b) + kChunk); };
  const auto q_rows = [&](int64_t b) { return k_rows(b) + kChunk * ks; };
  const auto do_rows = [&](int64_t b) { return q_rows(b) + kChunk * ks; };
  for (int64_t e = threadIdx.x; e < kMaxDim * kColTile + 2 * kChunk * kColTile + kStages * chunk_floats;
       e += kThreads) {
    ds[e] = 0.0f;  // the state gradient, and the staged rows' padding
  }
  __syncthreads();
  const int64_t begin = cu[doc], end = cu[doc + 1], base = begin / kChunk + doc;
  const int64_t chunks = (end - begin + kChunk - 1) / kChunk;
  const int64_t kstride = int64_t(d.hk) * d.dk, vstride = int64_t(d.hv) * d.dv, hstride = int64_t(d.hv) * d.dk;
  const auto chunk_len = [&](int64_t c) {
    return static_cast<int>(end - begin - c * kChunk < kChunk ? end - begin - c * kChunk : kChunk);
  };
  // The n-th chunk walked is chunk chunks - 1 - n.
  const auto stage_chunk = [&](int64_t n) {
    if (n < chunks) {
      const int64_t c = chunks - 1 - n, t0 = begin + c * kChunk, b = n % kStages;
      const int len = chunk_len(c);
      copy_rows_async(w_rows(b), ks, w + head_key_row(d, t0, h), hstride, len, d.dk);
      copy_rows_async(du_rows(b), kColTile, du + value_row(d, t0, h) + c0, vstride, len, nc);
      copy_rows_async(g_raw(b), 1, g + t0 * d.hv + h, d.hv, len, 1);
      copy_rows_async(k_rows(b), ks, k + key_row(d, t0, kh), kstride, len, d.dk);
      copy_rows_async(q_rows(b), ks, q + key_row(d, t0, kh), kstride, len, d.dk);
      copy_rows_async(do_rows(b), kColTile, dout + value_row(d, t0, h) + c0, vstride, len, nc);
    }
    commit_copies();
  };
  float grad[8][2] = {};
  if (kStages > 1) stage_chunk(0);
  for (int64_t n = 0; n < chunks; ++n) {
    await_chunk<kStages>(n, stage_chunk);
    const int64_t c = chunks - 1 - n, t0 = begin + c * kChunk, slot = base + c, b = n % kStages;
    const int len = chunk_len(c);
    scan_chunk_gates(nullptr, G, F, g_raw(b), len);
    store_state_block(dstates + state_at(d, slot, h) + c0, grad, ty, tx, d.dk, d.dv, nc);
    __syncthreads();
    {
      float acc[4][2] = {};
      if (ty * 4 < len) rows_times_state(acc, k_rows(b), ks, ds, ty * 4, tx * 2);
      const float* dub = du_rows(b);
      const T* dob = do_rows(b);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int i = ty * 4 + r, j = tx * 2 + cc;
          if (i >= len) continue;
          float val = 0.0f, o = 0.0f;
          if (j < nc) {
            val = dub[i * kColTile + j] + F[i] * acc[r][cc];
            du[value_row(d, t0 + i, h) + c0 + j] = val;
            o = G[i] * d.scale * load_float(dob + i * kColTile + j);
          }
          sdu[i * kColTile + j] = val;
          sdo[i * kColTile + j] = o;
        }
      }
    }
    __syncthreads();
    if (ty * 8 < d.dk) {
      const float last = G[len - 1];
      float acc[8][2] = {};
      const T* qb = q_rows(b);
      const float* wb = w_rows(b);
      for (int e = 0; e < len; ++e) {
        float qv[8], wv[8];
        load_row8(qb + e * ks + ty * 8, qv);
        load_row8(wb + e * ks + ty * 8, wv);
        const float2 ov = *reinterpret_cast<const float2*>(sdo + e * kColTile + tx * 2);
        const float2 uv = *reinterpret_cast<const float2*>(sdu + e * kColTile + tx * 2);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          acc[r][0] += qv[r] * ov.x - wv[r] * uv.x;
          acc[r][1] += qv[r] * ov.y - wv[r] * uv.y;
        }
      }
      decay_and_add(grad, acc, last, ds, ty, tx);
    }
    __syncthreads();  // dS for the next chunk's dU; this chunk's buffer free for the copies ahead
  }
}

// Per (chunk slot, value head), from S0 (start state), dSL (end-state gradient), U, dU, Tm: dv, dbeta, dg and the
// head's dq, dk rows (f32 [T, Hv, dk]). Y = Tm^T dU; dv = diag(beta) Y; dA = -Y U^T (strictly lower), dC = dO U^T;
// dq' = diag(G) dO S0^T + (dC . M) K; dk = -diag(beta G) Y S0^T + diag(F) U dSL^T + (B + B^T) K + (dC . M)^T Q'
// with B = dA . beta_i exp(gc_i - gc_j); dgc from every exp(gc) factor (the masks' row minus column sums of
// dX . X, G in O and in u, F and G_last in the end state), dg its reverse cumsum over the chunk.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_kernel(float* dq_heads, float* dk_heads, T* dv, float* dg, float* dbeta, const float* states,
                const float* dstates, const float* big_u, const float* du, const float* tmat, const T* dout, const T* q,
                const T* k, const T* v, const float* g, const float* beta, const int32_t* chunk_start,
                const int32_t* chunk_len, Dims d) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, kh = h / d.group, len = chunk_len[slot];
  if (len == 0) return;
  const int64_t t0 = chunk_start[slot];
  extern __shared__ float smem[];
  float* gates = smem;
  const float *gc = gates, *bt = gates + kChunk, *G = bt + kChunk, *F = G + kChunk;
  float* dgc = gates + kGateFloats;  // [kChunk]
  float* dbt = dgc + kChunk;         // [kChunk]
  float* r4 = dbt + kChunk;          // [kChunk]
  float* red = r4 + kChunk;          // [kThreads]
  float* tt = red + kThreads;        // [kChunk][kLd]: Tm, then dC, then the dbeta terms
  float* kk = tt + kSquare;          // K K^T, then B
  float* da = kk + kSquare;          // dA, then the dgc terms
  float* cm = da + kSquare;          // the decayed scores, then dC . M
  float* sy = cm + kSquare;          // [kChunk][dv]: Y, then K dSL
  float* stage = sy + kChunk * d.dv;
  load_gates(gates, g, beta, t0, len, h, d.hv);
  const float* tsrc = tmat + (slot * d.hv + h) * kChunk * kChunk;
  for (int e = threadIdx.x; e < len * len; e += kThreads)
    tt[(e / len) * kLd + e % len] = tsrc[(e / len) * kChunk + e % len];
  __syncthreads();
  const int64_t kstride = int64_t(d.hk) * d.dk, vstride = int64_t(d.hv) * d.dv, hstride = int64_t(d.hv) * d.dk;
  const T* qc = q + key_row(d, t0, kh);
  const T* kc = k + key_row(d, t0, kh);
  const T* vc = v + value_row(d, t0, h);
  const T* dorow = dout + value_row(d, t0, h);
  const float* uc = big_u + value_row(d, t0, h);
  const float* duc = du + value_row(d, t0, h);
  const float* s0 = states + state_at(d, slot, h);
  const float* dsl = dstates + state_at(d, slot, h);
  float* dqc = dq_heads + head_key_row(d, t0, h);
  float* dkc = dk_heads + head_key_row(d, t0, h);
  const auto kat = [&](int i, int e) { return load_float(kc + i * kstride + e); };
  const auto qat = [&](int i, int e) { return d.scale * load_float(qc + i * kstride + e); };
  const auto uat = [&](int i, int e) { return uc[i * vstride + e]; };
  const auto doat = [&](int i, int e) { return load_float(dorow + i * vstride + e); };

  // Y = Tm^T dU; dv = diag(beta) Y.
  block_gemm<4, 4, false, true>(
      len, d.dv, len, [&](int i, int j) { return tt[j * kLd + i]; }, [&](int j, int n) { return duc[j * vstride + n]; },
      [&](int i, int n, float x) { sy[i * d.dv + n] = x; }, stage);
  for (int e = threadIdx.x; e < len * d.dv; e += kThreads) {
    const int i = e / d.dv, n = e % d.dv;
    store_float(dv + value_row(d, t0 + i, h) + n, bt[i] * sy[e]);
  }
  // The chunk x chunk products: K K^T, the scores, dA = -Y U^T, dC = dO U^T (over Tm, no longer needed).
  block_gemm<4, 4, true, false>(
      len, len, d.dk, kat, [&](int e, int j) { return kat(j, e); }, [&](int i, int j, float x) { kk[i * kLd + j] = x; },
      stage);
  decayed_scores(cm, gc, qc, kc, len, d, stage);
  block_gemm<4, 4, true, false>(
      len, len, d.dv, [&](int i, int e) { return sy[i * d.dv + e]; }, [&](int e, int j) { return uat(j, e); },
      [&](int i, int j, float x) { da[i * kLd + j] = -x; }, stage);
  block_gemm<4, 4, true, false>(
      len, len, d.dv, doat, [&](int e, int j) { return uat(j, e); },
      [&](int i, int j, float x) { tt[i * kLd + j] = x; }, stage);
  // Elementwise: B, the dgc terms P = dA . A + dC . C, dC . M, the dbeta terms dA . (k_i . k_j) exp(gc_i - gc_j).
  for (int e = threadIdx.x; e < len * len; e += kThreads) {
    const int i = e / len, j = e % len, at = i * kLd + j;
    float p = 0.0f, b = 0.0f, dcm = 0.0f, db = 0.0f;
    if (j <= i) {
      const float decay = j < i ? expf(gc[i] - gc[j]) : 1.0f;
      if (j < i) {
        const float grad = da[at], a = bt[i] * kk[at] * decay;
        p = grad * a;
        b = grad * bt[i] * decay;
        db = grad * kk[at] * decay;
      }
      const float dc = tt[at];
      p += dc * cm[at];  // cm already holds the decayed score
      dcm = dc * decay;
    }
    kk[at] = b;
    da[at] = p;
    cm[at] = dcm;
    tt[at] = db;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < len; i += kThreads) {
    float sg = 0.0f, sb = 0.0f;
    for (int j = 0; j < len; ++j) {
      sg += da[i * kLd + j] - da[j * kLd + i];
      sb += tt[i * kLd + j];
    }
    dgc[i] = sg;
    dbt[i] = sb;
  }
  __syncthreads();
  // dq' = X1 + (dC . M) K with X1 = diag(G) dO S0^T (kept in the dq rows first: dgc_i += q'_i . X1_i).
  block_gemm<4, 4, true, false>(
      len, d.dk, d.dv, [&](int i, int e) { return G[i] * doat(i, e); }, [&](int e, int n) { return s0[n * d.dv + e]; },
      [&](int i, int n, float x) { dqc[i * hstride + n] = x; }, stage);
  row_sums(
      len, d.dk, [&](int i, int e) { return qat(i, e) * dqc[i * hstride + e]; }, [&](int i, float s) { dgc[i] += s; });
  block_gemm<4, 4, true, true>(
      len, d.dk, len, [&](int i, int j) { return cm[i * kLd + j]; }, kat,
      [&](int i, int n, float x) { dqc[i * hstride + n] = d.scale * (dqc[i * hstride + n] + x); }, stage);
  // X2 = Y S0^T in the dk rows: r_i = k_i . X2_i; dbeta_i += Y_i . v_i - G_i r_i; dgc_i -= beta_i G_i r_i.
  block_gemm<4, 4, true, false>(
      len, d.dk, d.dv, [&](int i, int e) { return sy[i * d.dv + e]; }, [&](int e, int n) { return s0[n * d.dv + e]; },
      [&](int i, int n, float x) { dkc[i * hstride + n] = x; }, stage);
  row_sums(
      len, d.dk, [&](int i, int e) { return kat(i, e) * dkc[i * hstride + e]; }, [&](int i, float s) { r4[i] = s; });
  row_sums(
      len, d.dv, [&](int i, int e) { return sy[i * d.dv + e] * load_float(vc + i * vstride + e); },
      [&](int i, float s) {
        dbt[i] += s - G[i] * r4[i];
        dgc[i] -= bt[i] * G[i] * r4[i];
      });
  // Z = K dSL over Y: r4_j = F_j U_j . Z_j; dgc_j -= r4_j; dgc_last += sum_j r4_j + G_last <S0, dSL>.
  block_gemm<4, 4, true, true>(
      len, d.dv, d.dk, kat, [&](int e, int n) { return dsl[e * d.dv + n]; },
      [&](int i, int n, float x) { sy[i * d.dv + n] = x; }, stage);
  row_sums(
      len, d.dv, [&](int i, int e) { return uat(i, e) * sy[i * d.dv + e]; },
      [&](int i, float s) {
        r4[i] = F[i] * s;
        dgc[i] -= F[i] * s;
      });
  {
    float part = 0.0f;
    for (int e = threadIdx.x; e < d.dk * d.dv; e += kThreads) part += s0[e] * dsl[e];
    red[threadIdx.x] = part;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sd = 0.0f, sr = 0.0f;
    for (int i = 0; i < kThreads; ++i) sd += red[i];
    for (int i = 0; i < len; ++i) sr += r4[i];
    dgc[len - 1] += G[len - 1] * sd + sr;
  }
  // dk = -diag(beta G) X2 + diag(F) U dSL^T, then + (B + B^T) K + (dC . M)^T Q' over [K ; Q'].
  block_gemm<4, 4, true, false>(
      len, d.dk, d.dv, uat, [&](int e, int n) { return dsl[n * d.dv + e]; },
      [&](int i, int n, float x) { dkc[i * hstride + n] = -bt[i] * G[i] * dkc[i * hstride + n] + F[i] * x; }, stage);
  block_gemm<4, 4, true, true>(
      len, d.dk, 2 * len,
      [&](int i, int e) { return e < len ? kk[i * kLd + e] + kk[e * kLd + i] : cm[(e - len) * kLd + i]; },
      [&](int e, int n) { return e < len ? kat(e, n) : qat(e - len, n); },
      [&](int i, int n, float x) { dkc[i * hstride + n] += x; }, stage);
  if (threadIdx.x == 0) {
    float acc = 0.0f;
    for (int i = len - 1; i >= 0; --i) {
      acc += dgc[i];
      dg[(t0 + i) * d.hv + h] = acc;
    }
  }
  for (int i = threadIdx.x; i < len; i += kThreads) dbeta[(t0 + i) * d.hv + h] = dbt[i];
}

using gated_delta_detail::dispatch_activation;
using gated_delta_detail::group_sum_kernel;

Dims dims_of(const Tensor& q, const Tensor& v, const Tensor& cu_seqlens, float scale) {
  Dims d{q.size(0),
         cu_seqlens.numel() - 1,
         0,
         static_cast<int>(q.size(1)),
         static_cast<int>(v.size(1)),
         static_cast<int>(q.size(2)),
         static_cast<int>(v.size(2)),
         0,
         scale};
  d.slots = d.tokens / kChunk + d.docs;
  d.group = d.hv / d.hk;
  MT_CHECK(d.dk <= kMaxDim && d.dv <= kMaxDim,
           "gated_delta_rule (CUDA, chunked): expected dk <= 128 and dv <= 128 but found dk = {}, dv = {}", d.dk, d.dv);
  return d;
}

// Runs launch(kernel, shared bytes) for a state pass with two staged chunks when they fit in a block's shared memory
// (bf16 activations at dk = 128 do), else one; the kernel is kernel_of(std::integral_constant<int, stages>).
template <typename T, bool kBackward, class KernelOf, class Launch>
void launch_state_pass(int dk, KernelOf kernel_of, Launch launch) {
  int device = 0, optin = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const auto run = [&](auto stages) {
    const auto kernel = kernel_of(stages);
    const size_t shared = state_pass_shared<T>(dk, kBackward, decltype(stages)::value);
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    launch(kernel, shared);
  };
  if (state_pass_shared<T>(dk, kBackward, 2) <= static_cast<size_t>(optin)) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

// Shared memory of each kernel, in bytes.
size_t prepare_shared() { return sizeof(float) * (kGateFloats + 2 * kSquare + kStageFloats); }
size_t scores_shared() { return sizeof(float) * (kGateFloats + kSquare + kStageFloats); }
size_t grad_shared(const Dims& d) {
  return sizeof(float) * (kGateFloats + 3 * kChunk + kThreads + 4 * kSquare + kChunk * d.dv + kStageFloats);
}

// The forward's intermediates: the chunk table, w, u, U and the chunk-start states, and Tm when asked.
struct Forward {
  Tensor table, w, u, big_u, states, tmat;
  const int32_t* start() const { return static_cast<const int32_t*>(table.raw_data()); }
  const int32_t* len(const Dims& d) const { return start() + d.slots; }
};

template <typename T>
Forward run_forward_state(const Stream& stream, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& cu_seqlens, const Dims& d, bool keep_tmat) {
  const Device dev = k.device();
  const cudaStream_t cs = native(stream);
  Forward f;
  f.table = Tensor::empty({2, d.slots}, DType::I32, dev);
  f.w = Tensor::empty({d.tokens, d.hv, d.dk}, DType::F32, dev);
  f.u = Tensor::empty({d.tokens, d.hv, d.dv}, DType::F32, dev);
  f.big_u = Tensor::empty({d.tokens, d.hv, d.dv}, DType::F32, dev);
  f.states = Tensor::empty({d.slots, d.hv, d.dk, d.dv}, DType::F32, dev);
  if (keep_tmat) f.tmat = Tensor::empty({d.slots, d.hv, kChunk, kChunk}, DType::F32, dev);
  int32_t* start = static_cast<int32_t*>(f.table.raw_data());
  const int32_t* cu = static_cast<const int32_t*>(cu_seqlens.raw_data());
  MT_CUDA_CHECK(cudaMemsetAsync(start + d.slots, 0, sizeof(int32_t) * d.slots, cs));
  {
    const OpScope table_scope(stream, "gated_delta.chunk_table");
    chunk_table_kernel<<<static_cast<unsigned>(std::min<int64_t>((d.docs + kThreads - 1) / kThreads, 65535)), kThreads,
                         0, cs>>>(start, start + d.slots, cu, d.docs);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  const dim3 chunk_grid(static_cast<unsigned>(d.slots), static_cast<unsigned>(d.hv));
  {
    const OpScope prepare_scope(stream, "gated_delta.prepare");
    prepare_kernel<T><<<chunk_grid, kThreads, prepare_shared(), cs>>>(
        static_cast<float*>(f.w.raw_data()), static_cast<float*>(f.u.raw_data()),
        keep_tmat ? static_cast<float*>(f.tmat.raw_data()) : nullptr, static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const float*>(g.raw_data()),
        static_cast<const float*>(beta.raw_data()), f.start(), f.len(d), d);
    MT_CUDA_CHECK(cudaGetLastError());
  }
  const dim3 state_grid(static_cast<unsigned>(d.docs), static_cast<unsigned>(d.hv),
                        static_cast<unsigned>((d.dv + kColTile - 1) / kColTile));
  {
    const OpScope state_scope(stream, "gated_delta.state_forward");
    launch_state_pass<T, false>(
        d.dk, [](auto stages) { return state_forward_kernel<T, decltype(stages)::value>; },
        [&](auto kernel, size_t shared) {
          kernel<<<state_grid, kThreads, shared, cs>>>(
              static_cast<float*>(f.states.raw_data()), static_cast<float*>(f.big_u.raw_data()),
              static_cast<const float*>(f.w.raw_data()), static_cast<const float*>(f.u.raw_data()),
              static_cast<const T*>(k.raw_data()), static_cast<const float*>(g.raw_data()), cu, d);
          MT_CUDA_CHECK(cudaGetLastError());
        });
  }
  return f;
}

// The forward's intermediates as gated_delta_rule_chunked_forward saved them: {table, w, U, states, Tm}, each checked
// against the shapes these dims give (u is not needed by the backward and not kept).
Forward forward_from_saved(const std::vector<Tensor>& saved, const Dims& d, Device dev) {
  MT_CHECK(saved.size() == 5,
           "gated_delta_rule_backward (CUDA): expected the 5 tensors a chunked forward saves but found {}",
           saved.size());
  const std::vector<std::pair<const char*, Shape>> expected = {{"chunk table", {2, d.slots}},
                                                               {"w", {d.tokens, d.hv, d.dk}},
                                                               {"U", {d.tokens, d.hv, d.dv}},
                                                               {"states", {d.slots, d.hv, d.dk, d.dv}},
                                                               {"Tm", {d.slots, d.hv, kChunk, kChunk}}};
  for (size_t i = 0; i < expected.size(); ++i) {
    const DType dtype = i == 0 ? DType::I32 : DType::F32;
    MT_CHECK(saved[i].shape() == expected[i].second && saved[i].dtype() == dtype && saved[i].device() == dev &&
                 saved[i].is_contiguous(),
             "gated_delta_rule_backward (CUDA): the saved {} is {}, expected {} {} on {} (saved by another call?)",
             expected[i].first, saved[i].describe(), dtype_name(dtype), shape_str(expected[i].second), dev.str());
  }
  Forward f;
  f.table = saved[0];
  f.w = saved[1];
  f.big_u = saved[2];
  f.states = saved[3];
  f.tmat = saved[4];
  return f;
}

}  // namespace

void gated_delta_rule_chunked_forward(const Stream& stream, const Tensor& out, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                      float scale, std::vector<Tensor>* saved) {
  const Dims d = dims_of(q, v, cu_seqlens, scale);
  dispatch_activation(q, "gated_delta_rule_forward", [&]<typename T>(T*) {
    const Forward f = run_forward_state<T>(stream, k, v, g, beta, cu_seqlens, d, saved != nullptr);
    if (saved != nullptr) *saved = {f.table, f.w, f.big_u, f.states, f.tmat};
    {
      const OpScope output_scope(stream, "gated_delta.output");
      output_kernel<T><<<dim3(static_cast<unsigned>(d.slots), static_cast<unsigned>(d.hv)), kThreads, scores_shared(),
                         native(stream)>>>(
          static_cast<T*>(out.raw_data()), static_cast<const float*>(f.states.raw_data()),
          static_cast<const float*>(f.big_u.raw_data()), static_cast<const T*>(q.raw_data()),
          static_cast<const T*>(k.raw_data()), static_cast<const float*>(g.raw_data()), f.start(), f.len(d), d);
      MT_CUDA_CHECK(cudaGetLastError());
    }
  });
}

void gated_delta_rule_chunked_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                       const Tensor& dg, const Tensor& dbeta, const Tensor& dout, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                       const Tensor& cu_seqlens, float scale, const std::vector<Tensor>* saved) {
  const Dims d = dims_of(q, v, cu_seqlens, scale);
  const cudaStream_t cs = native(stream);
  dispatch_activation(q, "gated_delta_rule_backward", [&]<typename T>(T*) {
    const Device dev = q.device();
    const Forward f = saved != nullptr ? forward_from_saved(*saved, d, dev)
                                       : run_forward_state<T>(stream, k, v, g, beta, cu_seqlens, d, true);
    const dim3 chunk_grid(static_cast<unsigned>(d.slots), static_cast<unsigned>(d.hv));
    const T* qp = static_cast<const T*>(q.raw_data());
    const T* kp = static_cast<const T*>(k.raw_data());
    const T* dop = static_cast<const T*>(dout.raw_data());
    const float* gp = static_cast<const float*>(g.raw_data());
    Tensor du_rows = Tensor::empty({d.tokens, d.hv, d.dv}, DType::F32, dev);
    float* du = static_cast<float*>(du_rows.raw_data());
    {
      const OpScope local_du_scope(stream, "gated_delta.local_du");
      local_du_kernel<T><<<chunk_grid, kThreads, scores_shared(), cs>>>(du, dop, qp, kp, gp, f.start(), f.len(d), d);
      MT_CUDA_CHECK(cudaGetLastError());
    }
    Tensor dstates = Tensor::empty({d.slots, d.hv, d.dk, d.dv}, DType::F32, dev);
    const dim3 state_grid(static_cast<unsigned>(d.docs), static_cast<unsigned>(d.hv),
                          static_cast<unsigned>((d.dv + kColTile - 1) / kColTile));
    {
      const OpScope state_scope(stream, "gated_delta.state_backward");
      launch_state_pass<T, true>(
          d.dk, [](auto stages) { return state_backward_kernel<T, decltype(stages)::value>; },
          [&](auto kernel, size_t shared) {
            kernel<<<state_grid, kThreads, shared, cs>>>(static_cast<float*>(dstates.raw_data()), du,
                                                         static_cast<const float*>(f.w.raw_data()), qp, kp, dop, gp,
                                                         static_cast<const int32_t*>(cu_seqlens.raw_data()), d);
            MT_CUDA_CHECK(cudaGetLastError());
          });
    }
    Tensor dq_heads = Tensor::empty({d.tokens, d.hv, d.dk}, DType::F32, dev);
    Tensor dk_heads = Tensor::empty({d.tokens, d.hv, d.dk}, DType::F32, dev);
    const size_t shared = grad_shared(d);
    MT_CUDA_CHECK(
        cudaFuncSetAttribute(grad_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    {
      const OpScope grad_scope(stream, "gated_delta.grad");
      grad_kernel<T><<<chunk_grid, kThreads, shared, cs>>>(
          static_cast<float*>(dq_heads.raw_data()), static_cast<float*>(dk_heads.raw_data()),
          static_cast<T*>(dv.raw_data()), static_cast<float*>(dg.raw_data()), static_cast<float*>(dbeta.raw_data()),
          static_cast<const float*>(f.states.raw_data()), static_cast<const float*>(dstates.raw_data()),
          static_cast<const float*>(f.big_u.raw_data()), du, static_cast<const float*>(f.tmat.raw_data()), dop, qp, kp,
          static_cast<const T*>(v.raw_data()), gp, static_cast<const float*>(beta.raw_data()), f.start(), f.len(d), d);
      MT_CUDA_CHECK(cudaGetLastError());
    }
    const int64_t n = d.tokens * d.hk * d.dk;
    {
      const OpScope group_sum_scope(stream, "gated_delta.group_sum");
      group_sum_kernel<T><<<static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(1) << 20)),
                            kThreads, 0, cs>>>(static_cast<T*>(dq.raw_data()), static_cast<T*>(dk.raw_data()),
                                               static_cast<const float*>(dq_heads.raw_data()),
                                               static_cast<const float*>(dk_heads.raw_data()), d);
      MT_CUDA_CHECK(cudaGetLastError());
    }
  });
}

int64_t gated_delta_rule_chunked_workspace_bytes(int64_t tokens, int64_t docs, int64_t hv, int64_t dk, int64_t dv,
                                                 bool backward) {
  const int64_t slots = tokens / kChunk + docs;
  int64_t floats = tokens * hv * (dk + 2 * dv) + slots * hv * dk * dv;  // w, u, U, states
  if (backward)
    floats += slots * hv * (kChunk * kChunk + dk * dv) + tokens * hv * (2 * dk + dv);  // Tm, dS, dq / dk, dU
  return 4 * floats + 2 * slots * int64_t(sizeof(int32_t));
}

}  // namespace moetrain::ops::cuda
