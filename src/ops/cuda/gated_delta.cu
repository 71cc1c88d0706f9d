// defines: the CUDA Gated DeltaNet kernels, the formulas of ops/cpu/gated_delta.cpp in f32: the conv, the L2 norm, the
// gates and the gated RMSNorm elementwise or one warp per row; the gated delta rule as one block per (document, value
// head) scanning its tokens in order, the dk x dv state in registers (4 threads per value column, each with every 4th
// row), forward and backward (checkpointed states recomputed per chunk, then a reverse scan). Sums run in orders fixed
// by the shapes (lane-strided then butterflies, fixed row chunks then chunks in order): deterministic, no atomics.
#include "ops/cuda/gated_delta.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/gated_delta_common.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this
constexpr int kLanesPerColumn = 4;                // threads per value column of the rule's state
constexpr int kMaxRows = 32;                      // state rows per thread: dk <= 128
constexpr int kMaxRuleThreads = 512;              // dv <= 128

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

unsigned blocks_for(int64_t n, int64_t per_block) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxBlocks)));
}

__device__ __forceinline__ int64_t dmin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float softplus_grad(float x) {
  if (x > 20.0f) return 1.0f;
  const float z = expf(x);
  return z / (z + 1.0f);
}

// Butterfly sums: every lane ends with the same bits (a + b and b + a round alike), in an order fixed by the layout.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
// Over the 4 lanes of one value column (the rows of the state it holds).
__device__ __forceinline__ float column_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
// Over the 8 value columns of a warp, for each row slot (lanes of the same position in their column).
__device__ __forceinline__ float across_columns(float v) {
  for (int offset = 4; offset < 32; offset <<= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Each token's document [start, end), by binary search in cu_seqlens.
__global__ void doc_spans_kernel(int32_t* start, int32_t* end, const int32_t* cu, int64_t docs, int64_t tokens) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    int64_t lo = 0, hi = docs - 1;  // the last d with cu[d] <= t
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (cu[mid] <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    start[t] = cu[lo];
    end[t] = cu[lo + 1];
  }
}

template <typename T, typename W>
__device__ float conv_pre(const T* x, const W* w, int64_t t, int64_t c, int64_t channels, int64_t kernel,
                          int64_t start) {
  float sum = 0.0f;
  for (int64_t j = 0; j < kernel; ++j) {
    const int64_t src = t - (kernel - 1) + j;
    if (src >= start) sum += load_float(w + c * kernel + j) * load_float(x + src * channels + c);
  }
  return sum;
}

template <typename T, typename W>
__global__ void conv_forward_kernel(T* y, const T* x, const W* w, const int32_t* start, int64_t tokens,
                                    int64_t channels, int64_t kernel) {
  const int64_t n = tokens * channels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / channels, c = e % channels;
    const float pre = conv_pre(x, w, t, c, channels, kernel, start[t]);
    store_float(y + e, pre * sigmoid(pre));
  }
}

// Generation: sequence b's newest conv input is row lengths[b] - 1 of its history [B, capacity, C].
template <typename T, typename W>
__global__ void conv_decode_kernel(T* y, const T* history, const W* w, const int32_t* lengths, int64_t rows,
                                   int64_t capacity, int64_t channels, int64_t kernel) {
  const int64_t n = rows * channels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / channels, c = e % channels;
    const float pre = conv_pre(history + b * capacity * channels, w, int64_t(lengths[b]) - 1, c, channels, kernel, 0);
    store_float(y + e, pre * sigmoid(pre));
  }
}

template <typename T, typename W>
__global__ void conv_dpre_kernel(float* dpre, const T* dy, const T* x, const W* w, const int32_t* start, int64_t tokens,
                                 int64_t channels, int64_t kernel) {
  const int64_t n = tokens * channels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / channels, c = e % channels;
    dpre[e] = load_float(dy + e) * silu_grad(conv_pre(x, w, t, c, channels, kernel, start[t]));
  }
}

template <typename T, typename W>
__global__ void conv_dx_kernel(T* dx, const float* dpre, const W* w, const int32_t* end, int64_t tokens,
                               int64_t channels, int64_t kernel) {
  const int64_t n = tokens * channels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / channels, c = e % channels;
    float sum = 0.0f;
    for (int64_t j = kernel - 1; j >= 0; --j) {
      const int64_t dst = t + (kernel - 1) - j;
      if (dst < end[t]) sum += load_float(w + c * kernel + j) * dpre[dst * channels + c];
    }
    store_float(dx + e, sum);
  }
}

// partial[chunk, c * K + j] = sum over the chunk's rows t (ascending) of dpre[t, c] * x[t - (K-1) + j, c].
template <typename T>
__global__ void conv_dw_chunks_kernel(float* partial, const float* dpre, const T* x, const int32_t* start,
                                      int64_t tokens, int64_t channels, int64_t kernel, int64_t chunks) {
  const int64_t cols = channels * kernel;
  const int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (col >= cols) return;
  const int64_t c = col / kernel, j = col % kernel;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    float sum = 0.0f;
    const int64_t last = dmin(tokens, (chunk + 1) * kGdnRowsPerChunk);
    for (int64_t t = chunk * kGdnRowsPerChunk; t < last; ++t) {
      const int64_t src = t - (kernel - 1) + j;
      if (src >= start[t]) sum += dpre[t * channels + c] * load_float(x + src * channels + c);
    }
    partial[chunk * cols + col] = sum;
  }
}

// out[col] += sum over chunks (ascending) of partial[chunk, col].
__global__ void column_total_kernel(float* out, const float* partial, int64_t chunks, int64_t cols) {
  const int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) sum += partial[chunk * cols + col];
  out[col] += sum;
}

template <typename T>
__global__ void l2norm_forward_kernel(T* y, const T* x, int64_t rows, int64_t dim, float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t n = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; n < rows;
       n += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + n * dim;
    float sum = 0.0f;
    for (int64_t d = lane; d < dim; d += 32) sum += load_float(xr + d) * load_float(xr + d);
    const float r = 1.0f / sqrtf(warp_sum(sum) + eps);
    for (int64_t d = lane; d < dim; d += 32) store_float(y + n * dim + d, load_float(xr + d) * r);
  }
}

template <typename T>
__global__ void l2norm_backward_kernel(T* dx, const T* dy, const T* x, int64_t rows, int64_t dim, float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t n = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; n < rows;
       n += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + n * dim;
    const T* dyr = dy + n * dim;
    float sum = 0.0f, dot = 0.0f;
    for (int64_t d = lane; d < dim; d += 32) {
      sum += load_float(xr + d) * load_float(xr + d);
      dot += load_float(dyr + d) * load_float(xr + d);
    }
    const float r = 1.0f / sqrtf(warp_sum(sum) + eps);
    const float coef = r * r * r * warp_sum(dot);
    for (int64_t d = lane; d < dim; d += 32) {
      store_float(dx + n * dim + d, r * load_float(dyr + d) - load_float(xr + d) * coef);
    }
  }
}

template <typename T>
__global__ void gates_forward_kernel(float* g, float* beta, const T* a, const T* b, const float* A_log,
                                     const float* dt_bias, int64_t tokens, int64_t heads) {
  const int64_t n = tokens * heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e % heads;
    g[e] = -expf(A_log[h]) * softplus(load_float(a + e) + dt_bias[h]);
    beta[e] = sigmoid(load_float(b + e));
  }
}

template <typename T>
__global__ void gates_backward_kernel(T* da, T* db, const float* dg, const float* dbeta, const T* a, const T* b,
                                      const float* A_log, const float* dt_bias, int64_t tokens, int64_t heads) {
  const int64_t n = tokens * heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e % heads;
    store_float(da + e, dg[e] * -expf(A_log[h]) * softplus_grad(load_float(a + e) + dt_bias[h]));
    const float s = sigmoid(load_float(b + e));
    store_float(db + e, dbeta[e] * (s * (1.0f - s)));
  }
}

// Per chunk of rows and head: the sums of da (from dg, recomputed in f32 as gates_backward_kernel has it before
// rounding) into partial[0], and of dg * g into partial[1]; [2, chunks, H].
template <typename T>
__global__ void gates_chunks_kernel(float* partial, const float* dg, const T* a, const float* A_log,
                                    const float* dt_bias, int64_t tokens, int64_t heads, int64_t chunks) {
  const int64_t h = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (h >= heads) return;
  const float neg_a = -expf(A_log[h]);
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    float sum_bias = 0.0f, sum_alog = 0.0f;
    const int64_t last = dmin(tokens, (chunk + 1) * kGdnRowsPerChunk);
    for (int64_t t = chunk * kGdnRowsPerChunk; t < last; ++t) {
      const float x = load_float(a + t * heads + h) + dt_bias[h];
      sum_bias += dg[t * heads + h] * neg_a * softplus_grad(x);
      sum_alog += dg[t * heads + h] * (neg_a * softplus(x));
    }
    partial[chunk * heads + h] = sum_bias;
    partial[(chunks + chunk) * heads + h] = sum_alog;
  }
}

template <typename T>
__global__ void gated_norm_forward_kernel(T* y, float* rstd, const T* x, const T* z, const float* w, int64_t rows,
                                          int64_t dim, float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t n = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; n < rows;
       n += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + n * dim;
    float sum = 0.0f;
    for (int64_t d = lane; d < dim; d += 32) sum += load_float(xr + d) * load_float(xr + d);
    const float r = 1.0f / sqrtf(warp_sum(sum) / static_cast<float>(dim) + eps);
    if (lane == 0) rstd[n] = r;
    for (int64_t d = lane; d < dim; d += 32) {
      const float zv = load_float(z + n * dim + d);
      store_float(y + n * dim + d, (w[d] * (load_float(xr + d) * r)) * (zv * sigmoid(zv)));
    }
  }
}

template <typename T>
__global__ void gated_norm_backward_kernel(T* dx, T* dz, const T* dy, const T* x, const T* z, const float* w,
                                           const float* rstd, int64_t rows, int64_t dim) {
  const int lane = threadIdx.x % 32;
  for (int64_t n = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; n < rows;
       n += int64_t(gridDim.x) * kWarpsPerBlock) {
    const float r = rstd[n];
    float sum = 0.0f;
    for (int64_t d = lane; d < dim; d += 32) {
      const int64_t e = n * dim + d;
      const float zv = load_float(z + e);
      sum += (load_float(dy + e) * w[d] * (zv * sigmoid(zv))) * (load_float(x + e) * r);
    }
    const float mean = warp_sum(sum) / static_cast<float>(dim);
    for (int64_t d = lane; d < dim; d += 32) {
      const int64_t e = n * dim + d;
      const float zv = load_float(z + e), xhat = load_float(x + e) * r, dyv = load_float(dy + e);
      const float gx = dyv * w[d] * (zv * sigmoid(zv));
      store_float(dx + e, r * (gx - xhat * mean));
      store_float(dz + e, dyv * w[d] * xhat * silu_grad(zv));
    }
  }
}

template <typename T>
__global__ void gated_norm_dw_chunks_kernel(float* partial, const T* dy, const T* x, const T* z, const float* rstd,
                                            int64_t rows, int64_t dim, int64_t chunks) {
  const int64_t d = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (d >= dim) return;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    float sum = 0.0f;
    const int64_t last = dmin(rows, (chunk + 1) * kGdnRowsPerChunk);
    for (int64_t n = chunk * kGdnRowsPerChunk; n < last; ++n) {
      const float zv = load_float(z + n * dim + d);
      sum += load_float(dy + n * dim + d) * (load_float(x + n * dim + d) * rstd[n]) * (zv * sigmoid(zv));
    }
    partial[chunk * dim + d] = sum;
  }
}

struct RuleDims {
  int64_t tokens, docs;
  int hk, hv, dk, dv, group;
};

// The rule's shared inputs of token t: q (scaled) and k of the key head, v (and dout) of the value head.
template <typename T>
__device__ void load_token(float* qs, float* ks, float* vs, float* dos, const T* q, const T* k, const T* v,
                           const T* dout, int64_t t, int h, int kh, const RuleDims& d, float scale) {
  for (int e = threadIdx.x; e < d.dk; e += blockDim.x) {
    if (qs != nullptr) qs[e] = load_float(q + (t * d.hk + kh) * d.dk + e) * scale;
    ks[e] = load_float(k + (t * d.hk + kh) * d.dk + e);
  }
  for (int e = threadIdx.x; e < d.dv; e += blockDim.x) {
    vs[e] = load_float(v + (t * d.hv + h) * d.dv + e);
    if (dos != nullptr) dos[e] = load_float(dout + (t * d.hv + h) * d.dv + e);
  }
}

// One token's update of this thread's rows of the state: decay, u = beta * (v - S^T k), S += k u^T. Returns u.
__device__ __forceinline__ float rule_step(float (&s)[kMaxRows], const float* ks, const float* vs, float decay, float b,
                                           int col, int lane4, bool active, int dk) {
  float kv = 0.0f;
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    const int i = lane4 + kLanesPerColumn * r;
    if (i < dk) {
      s[r] *= decay;
      kv += s[r] * ks[i];
    }
  }
  kv = column_sum(kv);
  const float u = active ? b * (vs[col] - kv) : 0.0f;
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    const int i = lane4 + kLanesPerColumn * r;
    if (i < dk) s[r] += ks[i] * u;
  }
  return u;
}

template <typename T>
__global__ void __launch_bounds__(kMaxRuleThreads)
    rule_forward_kernel(T* out, const T* q, const T* k, const T* v, const float* g, const float* beta,
                        const int32_t* cu, RuleDims d, float scale, const float* initial_state, float* final_state) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* ks = qs + d.dk;
  float* vs = ks + d.dk;
  const int col = threadIdx.x / kLanesPerColumn, lane4 = threadIdx.x % kLanesPerColumn;
  const bool active = col < d.dv;
  for (int64_t item = blockIdx.x; item < d.docs * d.hv; item += gridDim.x) {
    const int64_t doc = item / d.hv;
    const int h = static_cast<int>(item % d.hv), kh = h / d.group;
    // The (document, head)'s state [dk, dv] in initial_state / final_state (f32, row-major): row i, column col.
    const int64_t state_at = item * int64_t(d.dk) * d.dv + col;
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      const int i = lane4 + kLanesPerColumn * r;
      s[r] = initial_state != nullptr && active && i < d.dk ? initial_state[state_at + int64_t(i) * d.dv] : 0.0f;
    }
    for (int64_t t = cu[doc]; t < cu[doc + 1]; ++t) {
      load_token(qs, ks, vs, static_cast<float*>(nullptr), q, k, v, static_cast<const T*>(nullptr), t, h, kh, d, scale);
      __syncthreads();
      rule_step(s, ks, vs, expf(g[t * d.hv + h]), beta[t * d.hv + h], col, lane4, active, d.dk);
      float o = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        const int i = lane4 + kLanesPerColumn * r;
        if (i < d.dk) o += s[r] * qs[i];
      }
      o = column_sum(o);
      if (active && lane4 == 0) store_float(out + (t * d.hv + h) * d.dv + col, o);
      __syncthreads();
    }
    if (final_state != nullptr && active) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        const int i = lane4 + kLanesPerColumn * r;
        if (i < d.dk) final_state[state_at + int64_t(i) * d.dv] = s[r];
      }
    }
  }
}

// The reverse scan of ops/cpu/gated_delta.cpp's rule_backward_item with this thread's rows. State slots are laid out
// [row slot r][thread] so a block's checkpoint and scratch accesses are coalesced. dq_heads / dk_heads [T, Hv, dk].
template <typename T>
__global__ void __launch_bounds__(kMaxRuleThreads)
    rule_backward_kernel(float* dq_heads, float* dk_heads, T* dv, float* dg, float* dbeta, float* checkpoints,
                         float* scratch, const T* dout, const T* q, const T* k, const T* v, const float* g,
                         const float* beta, const int32_t* cu, RuleDims d, float scale) {
  extern __shared__ float smem[];
  const int warps = blockDim.x / 32;
  float* qs = smem;
  float* ks = qs + d.dk;
  float* vs = ks + d.dk;
  float* dos = vs + d.dv;
  float* part_q = dos + d.dv;             // [warps, dk]
  float* part_k = part_q + warps * d.dk;  // [warps, dk]
  float* part_s = part_k + warps * d.dk;  // [2, warps]: dg, dbeta
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int col = tid / kLanesPerColumn, lane4 = tid % kLanesPerColumn;
  const bool active = col < d.dv;
  const int rows = (d.dk + kLanesPerColumn - 1) / kLanesPerColumn;
  const int64_t state = int64_t(rows) * blockDim.x;
  float* st_buf = scratch + blockIdx.x * (kGdnChunk * (state + blockDim.x));
  float* u_buf = st_buf + kGdnChunk * state;
  for (int64_t item = blockIdx.x; item < d.docs * d.hv; item += gridDim.x) {
    const int64_t doc = item / d.hv;
    const int h = static_cast<int>(item % d.hv), kh = h / d.group;
    const int64_t begin = cu[doc], end = cu[doc + 1];
    const int64_t chunks = (end - begin + kGdnChunk - 1) / kGdnChunk;
    // Chunk c of this document keeps its state at slot (begin / kGdnChunk + doc + c) of head h: disjoint per document.
    float* ckpt = checkpoints + ((begin / kGdnChunk + doc) * d.hv + h) * state;
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) s[r] = 0.0f;
    for (int64_t t = begin; t < end; ++t) {
      if ((t - begin) % kGdnChunk == 0) {
        float* dst = ckpt + ((t - begin) / kGdnChunk) * d.hv * state;
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) dst[r * blockDim.x + tid] = s[r];
        }
      }
      load_token(static_cast<float*>(nullptr), ks, vs, static_cast<float*>(nullptr), q, k, v,
                 static_cast<const T*>(nullptr), t, h, kh, d, scale);
      __syncthreads();
      rule_step(s, ks, vs, expf(g[t * d.hv + h]), beta[t * d.hv + h], col, lane4, active, d.dk);
      __syncthreads();
    }
    float ds[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) ds[r] = 0.0f;
    for (int64_t c = chunks - 1; c >= 0; --c) {
      const float* src = ckpt + c * d.hv * state;
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) s[r] = r < rows ? src[r * blockDim.x + tid] : 0.0f;
      const int64_t first = begin + c * kGdnChunk, stop = dmin(end, first + kGdnChunk);
      for (int64_t t = first; t < stop; ++t) {
        load_token(static_cast<float*>(nullptr), ks, vs, static_cast<float*>(nullptr), q, k, v,
                   static_cast<const T*>(nullptr), t, h, kh, d, scale);
        __syncthreads();
        const float decay = expf(g[t * d.hv + h]);
        float* st = st_buf + (t - first) * state;
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) st[r * blockDim.x + tid] = s[r] * decay;  // the decayed state, before the update
        }
        u_buf[(t - first) * blockDim.x + tid] =
            rule_step(s, ks, vs, decay, beta[t * d.hv + h], col, lane4, active, d.dk);
        __syncthreads();
      }
      for (int64_t t = stop - 1; t >= first; --t) {
        load_token(qs, ks, vs, dos, q, k, v, dout, t, h, kh, d, scale);
        __syncthreads();
        const float decay = expf(g[t * d.hv + h]), b = beta[t * d.hv + h];
        const float* st = st_buf + (t - first) * state;
        const float u = u_buf[(t - first) * blockDim.x + tid];
        const float do_col = active ? dos[col] : 0.0f;
        // dq_t = S_t dout_t (scaled when written), S_t = St + k u^T; dS += (scale q) dout^T; du, St^T k.
        float du = 0.0f, kv = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) {
            const int i = lane4 + kLanesPerColumn * r;
            const bool row = i < d.dk;
            const float sv = st[r * blockDim.x + tid];
            const float ki = row ? ks[i] : 0.0f;
            float pq = across_columns((sv + ki * u) * do_col);
            if (lane < kLanesPerColumn && row) part_q[warp * d.dk + i] = pq;
            if (row) ds[r] += qs[i] * do_col;
            du += ds[r] * ki;
            kv += sv * ki;
          }
        }
        du = column_sum(du);
        kv = column_sum(kv);
        const float dvj = b * du;
        float dbeta_part = (active && lane4 == 0) ? du * (vs[col] - kv) : 0.0f;
        if (active && lane4 == 0) store_float(dv + (t * d.hv + h) * d.dv + col, dvj);
        // dk_t = dS u - St dv; dS -= k dv^T; dg_t = <St, dS>; dS *= exp(g_t).
        float dg_part = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) {
            const int i = lane4 + kLanesPerColumn * r;
            const bool row = i < d.dk;
            const float sv = st[r * blockDim.x + tid];
            const float ki = row ? ks[i] : 0.0f;
            const float pk = across_columns(ds[r] * u - sv * dvj);
            if (lane < kLanesPerColumn && row) part_k[warp * d.dk + i] = pk;
            ds[r] -= ki * dvj;
            dg_part += sv * ds[r];
            ds[r] *= decay;
          }
        }
        dg_part = warp_sum(dg_part);
        dbeta_part = warp_sum(dbeta_part);
        if (lane == 0) {
          part_s[warp] = dg_part;
          part_s[warps + warp] = dbeta_part;
        }
        __syncthreads();
        for (int i = tid; i < d.dk; i += blockDim.x) {
          float sq = 0.0f, sk = 0.0f;
          for (int w = 0; w < warps; ++w) {
            sq += part_q[w * d.dk + i];
            sk += part_k[w * d.dk + i];
          }
          dq_heads[(t * d.hv + h) * d.dk + i] = scale * sq;
          dk_heads[(t * d.hv + h) * d.dk + i] = sk;
        }
        if (tid == 0) {
          float sg = 0.0f, sb = 0.0f;
          for (int w = 0; w < warps; ++w) {
            sg += part_s[w];
            sb += part_s[warps + w];
          }
          dg[t * d.hv + h] = sg;
          dbeta[t * d.hv + h] = sb;
        }
      }
    }
    __syncthreads();  // the last reads of part_* before the next item writes them
  }
}

using gated_delta_detail::dispatch_activation;
using gated_delta_detail::group_sum_kernel;

RuleDims rule_dims(const Tensor& q, const Tensor& v, const Tensor& cu_seqlens) {
  RuleDims d{q.size(0),
             cu_seqlens.numel() - 1,
             static_cast<int>(q.size(1)),
             static_cast<int>(v.size(1)),
             static_cast<int>(q.size(2)),
             static_cast<int>(v.size(2)),
             0};
  d.group = d.hv / d.hk;
  return d;
}

int rule_threads(const RuleDims& d) { return (d.dv * kLanesPerColumn + 31) / 32 * 32; }

// The token spans of the documents, [2, T] i32 on the device.
Tensor doc_spans(const Stream& stream, const Tensor& cu_seqlens, int64_t tokens) {
  Tensor spans = Tensor::empty({2, tokens}, DType::I32, cu_seqlens.device());
  int32_t* start = static_cast<int32_t*>(spans.raw_data());
  doc_spans_kernel<<<blocks_for(tokens, kThreads), kThreads, 0, native(stream)>>>(
      start, start + tokens, static_cast<const int32_t*>(cu_seqlens.raw_data()), cu_seqlens.numel() - 1, tokens);
  MT_CUDA_CHECK(cudaGetLastError());
  return spans;
}

int multiprocessors(const Device& device) {
  int count = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.index));
  return count;
}

}  // namespace

void causal_conv1d_silu_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                                const Tensor& cu_seqlens) {
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = w.size(1);
  const Tensor spans = doc_spans(stream, cu_seqlens, tokens);
  const int32_t* start = static_cast<const int32_t*>(spans.raw_data());
  dispatch_activation(x, "causal_conv1d_silu_forward", [&]<typename T>(T*) {
    dispatch_activation(w, "causal_conv1d_silu_forward: w", [&]<typename W>(W*) {
      conv_forward_kernel<<<blocks_for(tokens * channels, kThreads), kThreads, 0, native(stream)>>>(
          static_cast<T*>(y.raw_data()), static_cast<const T*>(x.raw_data()), static_cast<const W*>(w.raw_data()),
          start, tokens, channels, kernel);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void causal_conv1d_silu_decode(const Stream& stream, const Tensor& y, const Tensor& history, const Tensor& w,
                               const Tensor& lengths) {
  const int64_t rows = history.size(0), capacity = history.size(1), channels = history.size(2), kernel = w.size(1);
  dispatch_activation(history, "causal_conv1d_silu_decode", [&]<typename T>(T*) {
    dispatch_activation(w, "causal_conv1d_silu_decode: w", [&]<typename W>(W*) {
      conv_decode_kernel<<<blocks_for(rows * channels, kThreads), kThreads, 0, native(stream)>>>(
          static_cast<T*>(y.raw_data()), static_cast<const T*>(history.raw_data()), static_cast<const W*>(w.raw_data()),
          static_cast<const int32_t*>(lengths.raw_data()), rows, capacity, channels, kernel);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void causal_conv1d_silu_backward(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                 const Tensor& x, const Tensor& w, const Tensor& cu_seqlens) {
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = w.size(1);
  const Tensor spans = doc_spans(stream, cu_seqlens, tokens);
  const int32_t* start = static_cast<const int32_t*>(spans.raw_data());
  const int32_t* end = start + tokens;
  const cudaStream_t cu_stream = native(stream);
  Tensor dpre = Tensor::empty({tokens, channels}, DType::F32, x.device());
  float* dp = static_cast<float*>(dpre.raw_data());
  const int64_t chunks = (tokens + kGdnRowsPerChunk - 1) / kGdnRowsPerChunk, cols = channels * kernel;
  Tensor partial = Tensor::empty({chunks, cols}, DType::F32, x.device());
  const unsigned column_blocks = blocks_for(cols, kThreads);
  const unsigned chunk_blocks = static_cast<unsigned>(std::min<int64_t>(chunks, 65535));
  dispatch_activation(x, "causal_conv1d_silu_backward", [&]<typename T>(T*) {
    dispatch_activation(w, "causal_conv1d_silu_backward: w", [&]<typename W>(W*) {
      conv_dpre_kernel<<<blocks_for(tokens * channels, kThreads), kThreads, 0, cu_stream>>>(
          dp, static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
          static_cast<const W*>(w.raw_data()), start, tokens, channels, kernel);
      MT_CUDA_CHECK(cudaGetLastError());
      conv_dx_kernel<<<blocks_for(tokens * channels, kThreads), kThreads, 0, cu_stream>>>(
          static_cast<T*>(dx.raw_data()), dp, static_cast<const W*>(w.raw_data()), end, tokens, channels, kernel);
      MT_CUDA_CHECK(cudaGetLastError());
    });
    conv_dw_chunks_kernel<<<dim3(column_blocks, chunk_blocks), kThreads, 0, cu_stream>>>(
        static_cast<float*>(partial.raw_data()), dp, static_cast<const T*>(x.raw_data()), start, tokens, channels,
        kernel, chunks);
  });
  MT_CUDA_CHECK(cudaGetLastError());
  column_total_kernel<<<column_blocks, kThreads, 0, cu_stream>>>(
      static_cast<float*>(dw.raw_data()), static_cast<const float*>(partial.raw_data()), chunks, cols);
  MT_CUDA_CHECK(cudaGetLastError());
}

void l2norm_forward(const Stream& stream, const Tensor& y, const Tensor& x, float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (rows == 0) return;
  dispatch_activation(x, "l2norm_forward", [&]<typename T>(T*) {
    l2norm_forward_kernel<<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, native(stream)>>>(
        static_cast<T*>(y.raw_data()), static_cast<const T*>(x.raw_data()), rows, dim, eps);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void l2norm_backward(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x, float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (rows == 0) return;
  dispatch_activation(x, "l2norm_backward", [&]<typename T>(T*) {
    l2norm_backward_kernel<<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, native(stream)>>>(
        static_cast<T*>(dx.raw_data()), static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()), rows,
        dim, eps);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_delta_gates_forward(const Stream& stream, const Tensor& g, const Tensor& beta, const Tensor& a,
                               const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
  const int64_t tokens = a.size(0), heads = a.size(1);
  dispatch_activation(a, "gated_delta_gates_forward", [&]<typename T>(T*) {
    gates_forward_kernel<<<blocks_for(tokens * heads, kThreads), kThreads, 0, native(stream)>>>(
        static_cast<float*>(g.raw_data()), static_cast<float*>(beta.raw_data()), static_cast<const T*>(a.raw_data()),
        static_cast<const T*>(b.raw_data()), static_cast<const float*>(A_log.raw_data()),
        static_cast<const float*>(dt_bias.raw_data()), tokens, heads);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_delta_gates_backward(const Stream& stream, const Tensor& da, const Tensor& db, const Tensor& dA_log,
                                const Tensor& ddt_bias, const Tensor& dg, const Tensor& dbeta, const Tensor& a,
                                const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
  const int64_t tokens = a.size(0), heads = a.size(1);
  const int64_t chunks = (tokens + kGdnRowsPerChunk - 1) / kGdnRowsPerChunk;
  const cudaStream_t cu_stream = native(stream);
  Tensor partial = Tensor::empty({2, chunks, heads}, DType::F32, a.device());
  float* pp = static_cast<float*>(partial.raw_data());
  const float* alog = static_cast<const float*>(A_log.raw_data());
  const float* bias = static_cast<const float*>(dt_bias.raw_data());
  const float* dgp = static_cast<const float*>(dg.raw_data());
  const unsigned column_blocks = blocks_for(heads, kThreads);
  dispatch_activation(a, "gated_delta_gates_backward", [&]<typename T>(T*) {
    gates_backward_kernel<<<blocks_for(tokens * heads, kThreads), kThreads, 0, cu_stream>>>(
        static_cast<T*>(da.raw_data()), static_cast<T*>(db.raw_data()), dgp,
        static_cast<const float*>(dbeta.raw_data()), static_cast<const T*>(a.raw_data()),
        static_cast<const T*>(b.raw_data()), alog, bias, tokens, heads);
    MT_CUDA_CHECK(cudaGetLastError());
    gates_chunks_kernel<<<dim3(column_blocks, static_cast<unsigned>(std::min<int64_t>(chunks, 65535))), kThreads, 0,
                          cu_stream>>>(pp, dgp, static_cast<const T*>(a.raw_data()), alog, bias, tokens, heads, chunks);
  });
  MT_CUDA_CHECK(cudaGetLastError());
  column_total_kernel<<<column_blocks, kThreads, 0, cu_stream>>>(static_cast<float*>(ddt_bias.raw_data()), pp, chunks,
                                                                 heads);
  MT_CUDA_CHECK(cudaGetLastError());
  column_total_kernel<<<column_blocks, kThreads, 0, cu_stream>>>(static_cast<float*>(dA_log.raw_data()),
                                                                 pp + chunks * heads, chunks, heads);
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_delta_rule_sequential_forward(const Stream& stream, const Tensor& out, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                         float scale, const Tensor& initial_state, const Tensor& final_state) {
  const RuleDims d = rule_dims(q, v, cu_seqlens);
  const int threads = rule_threads(d);
  const size_t shared = sizeof(float) * static_cast<size_t>(2 * d.dk + d.dv);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(d.docs * d.hv, kMaxBlocks));
  dispatch_activation(q, "gated_delta_rule_forward", [&]<typename T>(T*) {
    rule_forward_kernel<<<grid, threads, shared, native(stream)>>>(
        static_cast<T*>(out.raw_data()), static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const float*>(g.raw_data()),
        static_cast<const float*>(beta.raw_data()), static_cast<const int32_t*>(cu_seqlens.raw_data()), d, scale,
        initial_state.defined() ? static_cast<const float*>(initial_state.raw_data()) : nullptr,
        final_state.defined() ? static_cast<float*>(final_state.raw_data()) : nullptr);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_delta_rule_sequential_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          const Tensor& dg, const Tensor& dbeta, const Tensor& dout, const Tensor& q,
                                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens, float scale) {
  const RuleDims d = rule_dims(q, v, cu_seqlens);
  const int threads = rule_threads(d), warps = threads / 32;
  const int64_t state = int64_t((d.dk + kLanesPerColumn - 1) / kLanesPerColumn) * threads;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(d.docs * d.hv, multiprocessors(q.device())));
  // Checkpoint slots: documents d' < d use at most begin_d / kGdnChunk + d of them (see the kernel).
  Tensor checkpoints = Tensor::empty({(d.tokens / kGdnChunk + d.docs) * d.hv * state}, DType::F32, q.device());
  Tensor scratch = Tensor::empty({int64_t(grid) * kGdnChunk * (state + threads)}, DType::F32, q.device());
  Tensor dq_heads = Tensor::empty({d.tokens, d.hv, d.dk}, DType::F32, q.device());
  Tensor dk_heads = Tensor::empty({d.tokens, d.hv, d.dk}, DType::F32, q.device());
  const size_t shared = sizeof(float) * static_cast<size_t>(2 * d.dk + 2 * d.dv + 2 * warps * d.dk + 2 * warps);
  const cudaStream_t cu_stream = native(stream);
  dispatch_activation(q, "gated_delta_rule_backward", [&]<typename T>(T*) {
    rule_backward_kernel<<<grid, threads, shared, cu_stream>>>(
        static_cast<float*>(dq_heads.raw_data()), static_cast<float*>(dk_heads.raw_data()),
        static_cast<T*>(dv.raw_data()), static_cast<float*>(dg.raw_data()), static_cast<float*>(dbeta.raw_data()),
        static_cast<float*>(checkpoints.raw_data()), static_cast<float*>(scratch.raw_data()),
        static_cast<const T*>(dout.raw_data()), static_cast<const T*>(q.raw_data()),
        static_cast<const T*>(k.raw_data()), static_cast<const T*>(v.raw_data()),
        static_cast<const float*>(g.raw_data()), static_cast<const float*>(beta.raw_data()),
        static_cast<const int32_t*>(cu_seqlens.raw_data()), d, scale);
    MT_CUDA_CHECK(cudaGetLastError());
    group_sum_kernel<<<blocks_for(d.tokens * d.hk * d.dk, kThreads), kThreads, 0, cu_stream>>>(
        static_cast<T*>(dq.raw_data()), static_cast<T*>(dk.raw_data()), static_cast<const float*>(dq_heads.raw_data()),
        static_cast<const float*>(dk_heads.raw_data()), d);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& z,
                           const Tensor& w, float eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (rows == 0) return;
  dispatch_activation(x, "gated_rmsnorm_forward", [&]<typename T>(T*) {
    gated_norm_forward_kernel<<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, native(stream)>>>(
        static_cast<T*>(y.raw_data()), static_cast<float*>(rstd.raw_data()), static_cast<const T*>(x.raw_data()),
        static_cast<const T*>(z.raw_data()), static_cast<const float*>(w.raw_data()), rows, dim, eps);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void gated_rmsnorm_backward(const Stream& stream, const Tensor& dx, const Tensor& dz, const Tensor& dw,
                            const Tensor& dy, const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                            float /*eps: rstd holds it*/) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (rows == 0) return;
  const int64_t chunks = (rows + kGdnRowsPerChunk - 1) / kGdnRowsPerChunk;
  const cudaStream_t cu_stream = native(stream);
  Tensor partial = Tensor::empty({chunks, dim}, DType::F32, x.device());
  const unsigned column_blocks = blocks_for(dim, kThreads);
  dispatch_activation(x, "gated_rmsnorm_backward", [&]<typename T>(T*) {
    gated_norm_backward_kernel<<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, cu_stream>>>(
        static_cast<T*>(dx.raw_data()), static_cast<T*>(dz.raw_data()), static_cast<const T*>(dy.raw_data()),
        static_cast<const T*>(x.raw_data()), static_cast<const T*>(z.raw_data()),
        static_cast<const float*>(w.raw_data()), static_cast<const float*>(rstd.raw_data()), rows, dim);
    MT_CUDA_CHECK(cudaGetLastError());
    gated_norm_dw_chunks_kernel<<<dim3(column_blocks, static_cast<unsigned>(std::min<int64_t>(chunks, 65535))),
                                  kThreads, 0, cu_stream>>>(
        static_cast<float*>(partial.raw_data()), static_cast<const T*>(dy.raw_data()),
        static_cast<const T*>(x.raw_data()), static_cast<const T*>(z.raw_data()),
        static_cast<const float*>(rstd.raw_data()), rows, dim, chunks);
  });
  MT_CUDA_CHECK(cudaGetLastError());
  column_total_kernel<<<column_blocks, kThreads, 0, cu_stream>>>(
      static_cast<float*>(dw.raw_data()), static_cast<const float*>(partial.raw_data()), chunks, dim);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
