// defines: the CUDA RMSNorm kernels, the formulas of ops/cpu/norm.cpp in f32: rstd = 1 / sqrt(sum(x^2) / D + eps),
// y = (x * rstd) * scale, dx = rstd * (g - xhat * mean(g * xhat)) with g = scale * dy. A warp, or for narrow rows (q/k
// norm heads) a quarter or half of one, per row, reading it in 16-byte spans of 8 elements where D and the addresses
// allow; the weight gradient sums blocks of rows into a [blocks, D] buffer, then those sums by blocks again, in an
// order fixed by the row count. Every product and sum is
// written with the round-to-nearest intrinsics (__fmul_rn, __fadd_rn, ...), which nvcc never fuses into a
// multiply-add: each element rounds as the CPU's -ffp-contract=off code does, and only the summation orders differ.
// The fused residual add + norm is the forward kernel with elementwise.cu's add in front of it. Under bf16 compute
// with an f32 residual stream, x / a / sum / dx are f32 and y / b / dy bf16: each operand has its own element type.
#include "ops/cuda/norm.h"

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/norm_rows.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

using namespace norm_rows;

constexpr int kColumnThreads = 256;

// y's span at d = (v * rstd) * scale, as forward_rows and add_forward_rows write it.
template <int K, typename TY>
__device__ __forceinline__ void store_normed(TY* yr, int64_t d, float (&v)[K], float r, const float* w,
                                             bool zero_centered) {
  float scale[K];
  load_scale<K>(w + d, zero_centered, scale);
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = __fmul_rn(__fmul_rn(v[i], r), scale[i]);
  store_span<K>(yr + d, v);
}

template <int K, int Lanes, typename TY, typename TX>
__device__ void forward_rows(TY* y, float* rstd, const TX* x, const float* w, int64_t rows, int64_t dim, float eps,
                             bool zero_centered) {
  for_each_row<Lanes>(rows, [&](const RowLanes<Lanes> at) {
    const int64_t n = at.row, end = at.active ? dim : 0;
    const TX* xr = x + n * dim;
    TY* yr = y + n * dim;
    float sum_sq = 0.0f;
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float v[K];
      load_span<K>(xr + d, v);
#pragma unroll
      for (int i = 0; i < K; ++i) sum_sq = __fadd_rn(sum_sq, __fmul_rn(v[i], v[i]));
    }
    const float variance = __fdiv_rn(row_sum<Lanes>(sum_sq), static_cast<float>(dim));
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
    if (at.lane == 0 && at.active) rstd[n] = r;
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float v[K];
      load_span<K>(xr + d, v);
      store_normed<K>(yr, d, v, r, w, zero_centered);
    }
  });
}

template <int Lanes, typename TY, typename TX>
__global__ void forward_kernel(TY* y, float* rstd, const TX* x, const float* w, int64_t rows, int64_t dim, float eps,
                               bool zero_centered, bool packed) {
  if (packed) {
    forward_rows<8, Lanes>(y, rstd, x, w, rows, dim, eps, zero_centered);
  } else {
    forward_rows<1, Lanes>(y, rstd, x, w, rows, dim, eps, zero_centered);
  }
}

// forward_rows with the residual add in front: each lane adds (and stores) its spans of the row, squares the rounded
// sums as forward_rows squares x, then rereads its own stored elements of sum for y. Each lane reads a and b at an
// index before it writes sum there: sum may alias a or b.
template <int K, int Lanes, typename TS, typename TY, typename TA, typename TB>
__device__ void add_forward_rows(TS* sum, TY* y, float* rstd, const TA* a, const TB* b, const float* w, int64_t rows,
                                 int64_t dim, float eps, bool zero_centered) {
  for_each_row<Lanes>(rows, [&](const RowLanes<Lanes> at) {
    const int64_t n = at.row, end = at.active ? dim : 0;
    const TA* ar = a + n * dim;
    const TB* br = b + n * dim;
    TS* sr = sum + n * dim;
    TY* yr = y + n * dim;
    float sum_sq = 0.0f;
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float va[K], vb[K];
      load_span<K>(ar + d, va);
      load_span<K>(br + d, vb);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        va[i] = stored_value(__fadd_rn(va[i], vb[i]), sr);
        sum_sq = __fadd_rn(sum_sq, __fmul_rn(va[i], va[i]));
      }
      store_span<K>(sr + d, va);
    }
    const float variance = __fdiv_rn(row_sum<Lanes>(sum_sq), static_cast<float>(dim));
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
    if (at.lane == 0 && at.active) rstd[n] = r;
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float v[K];
      load_span<K>(sr + d, v);
      store_normed<K>(yr, d, v, r, w, zero_centered);
    }
  });
}

template <int Lanes, typename TS, typename TY, typename TA, typename TB>
__global__ void add_forward_kernel(TS* sum, TY* y, float* rstd, const TA* a, const TB* b, const float* w, int64_t rows,
                                   int64_t dim, float eps, bool zero_centered, bool packed) {
  if (packed) {
    add_forward_rows<8, Lanes>(sum, y, rstd, a, b, w, rows, dim, eps, zero_centered);
  } else {
    add_forward_rows<1, Lanes>(sum, y, rstd, a, b, w, rows, dim, eps, zero_centered);
  }
}

// The span at d of g = scale * dy and xhat = x * rstd, which both passes of the input gradient read.
template <int K, typename TDY, typename TX>
__device__ __forceinline__ void load_gradient_span(const TDY* dyr, const TX* xr, const float* w, int64_t d, float r,
                                                   bool zero_centered, float (&g)[K], float (&xhat)[K]) {
  float scale[K];
  load_span<K>(dyr + d, g);
  load_span<K>(xr + d, xhat);
  load_scale<K>(w + d, zero_centered, scale);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    g[i] = __fmul_rn(scale[i], g[i]);
    xhat[i] = __fmul_rn(xhat[i], r);
  }
}

// Stores a span of dx at d: g rounded to TDX, plus the addend row's elements (null: none) rounded again.
template <int K, typename TDX>
__device__ __forceinline__ void store_input_gradient(TDX* dxr, const TDX* addend_row, int64_t d, float (&g)[K]) {
  if (addend_row != nullptr) {
    float a[K];
    load_span<K>(addend_row + d, a);
#pragma unroll
    for (int i = 0; i < K; ++i) g[i] = __fadd_rn(stored_value(g[i], dxr), a[i]);
  }
  store_span<K>(dxr + d, g);
}

// Every lane reads all of its dy elements for the sum before the butterfly, which no lane leaves before all have
// entered it; then each lane rewrites only its own elements: dx may alias dy. With an addend (the residual's gradient;
// null for none) each element of dx is rounded to TDX, then the addend's element added and rounded again: the bits
// of the input gradient followed by accumulate(dx, addend).
template <int K, int Lanes, typename TDX, typename TDY, typename TX>
__device__ void backward_input_rows(TDX* dx, const TDY* dy, const TX* x, const float* w, const float* rstd,
                                    const TDX* addend, int64_t rows, int64_t dim, bool zero_centered) {
  for_each_row<Lanes>(rows, [&](const RowLanes<Lanes> at) {
    const int64_t n = at.row, end = at.active ? dim : 0;
    const TX* xr = x + n * dim;
    const TDY* dyr = dy + n * dim;
    TDX* dxr = dx + n * dim;
    const float r = at.active ? rstd[n] : 0.0f;
    float sum = 0.0f;
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float g[K], xhat[K];
      load_gradient_span<K>(dyr, xr, w, d, r, zero_centered, g, xhat);
#pragma unroll
      for (int i = 0; i < K; ++i) sum = __fadd_rn(sum, __fmul_rn(g[i], xhat[i]));
    }
    const float mean = __fdiv_rn(row_sum<Lanes>(sum), static_cast<float>(dim));
    for (int64_t d = at.lane * K; d < end; d += Lanes * K) {
      float g[K], xhat[K];
      load_gradient_span<K>(dyr, xr, w, d, r, zero_centered, g, xhat);
#pragma unroll
      for (int i = 0; i < K; ++i) g[i] = __fmul_rn(r, __fsub_rn(g[i], __fmul_rn(xhat[i], mean)));
      store_input_gradient<K>(dxr, addend == nullptr ? nullptr : addend + n * dim, d, g);
    }
  });
}

template <int Lanes, typename TDX, typename TDY, typename TX>
__global__ void backward_input_kernel(TDX* dx, const TDY* dy, const TX* x, const float* w, const float* rstd,
                                      const TDX* addend, int64_t rows, int64_t dim, bool zero_centered, bool packed) {
  if (packed) {
    backward_input_rows<8, Lanes>(dx, dy, x, w, rstd, addend, rows, dim, zero_centered);
  } else {
    backward_input_rows<1, Lanes>(dx, dy, x, w, rstd, addend, rows, dim, zero_centered);
  }
}

// The input gradient of backward_input_rows and the weight gradient's terms in one pass over the rows (a warp a row,
// in 16-byte spans of 8): pass 1 sums the row as backward_input_rows does; pass 2 reads dy and x again (from cache),
// forms each element's dx as backward_input_rows does and its weight term dy * (x * rstd) as add_terms does, and adds
// the term to the lane's sum of its column. After its rows each block adds its warps' sums in warp order into
// partial[block] [D], which add_column_sums takes into dw. A warp's rows are those for_each_row gives it over a grid
// fixed by the row count (weight_row_blocks), taken in ascending order, so each column's order of additions follows
// from the row count alone. A lane holds kMaxWeightSpans spans of sums: rows of up to 2048 elements.
constexpr int kMaxWeightSpans = 8;
constexpr int64_t kMaxWeightDim = int64_t{32} * 8 * kMaxWeightSpans;
constexpr int64_t kRowsPerWarpWithWeight = 4;
constexpr int64_t kMaxWeightBlocks = 2048;  // a larger row count strides: partial stays at most [2048, D]
static_assert(kRowThreads == 32 * 8, "a block's threads add one column each of a 256-column span of the warps' sums");

template <typename TDX, typename TDY, typename TX>
__global__ void __launch_bounds__(kRowThreads)
    backward_input_weight_kernel(TDX* dx, float* partial, const TDY* dy, const TX* x, const float* w,
                                 const float* rstd, const TDX* addend, int64_t rows, int64_t dim, bool zero_centered) {
  constexpr int K = 8;
  constexpr int kSpanStride = 32 * K;
  __shared__ float warp_sums[kWarpsPerBlock][kSpanStride];
  float sums[kMaxWeightSpans][K] = {};
  for_each_row<32>(rows, [&](const RowLanes<32> at) {
    const int64_t n = at.row;
    const TX* xr = x + n * dim;
    const TDY* dyr = dy + n * dim;
    TDX* dxr = dx + n * dim;
    const float r = rstd[n];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxWeightSpans; ++j) {
      const int64_t d = at.lane * K + j * kSpanStride;
      if (d >= dim) continue;
      float g[K], xhat[K];
      load_gradient_span<K>(dyr, xr, w, d, r, zero_centered, g, xhat);
#pragma unroll
      for (int i = 0; i < K; ++i) sum = __fadd_rn(sum, __fmul_rn(g[i], xhat[i]));
    }
    const float mean = __fdiv_rn(row_sum<32>(sum), static_cast<float>(dim));
#pragma unroll
    for (int j = 0; j < kMaxWeightSpans; ++j) {
      const int64_t d = at.lane * K + j * kSpanStride;
      if (d >= dim) continue;
      float g[K], xv[K], scale[K];
      load_span<K>(dyr + d, g);
      load_span<K>(xr + d, xv);
      load_scale<K>(w + d, zero_centered, scale);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const float xhat = __fmul_rn(xv[i], r);
        sums[j][i] = __fadd_rn(sums[j][i], __fmul_rn(g[i], xhat));
        g[i] = __fmul_rn(r, __fsub_rn(__fmul_rn(scale[i], g[i]), __fmul_rn(xhat, mean)));
      }
      store_input_gradient<K>(dxr, addend == nullptr ? nullptr : addend + n * dim, d, g);
    }
  });
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int j = 0; j < kMaxWeightSpans; ++j) {
    const int64_t first = int64_t{j} * kSpanStride;  // this span's columns: [first, first + 256)
    if (first >= dim) break;
#pragma unroll
    for (int i = 0; i < K; ++i) warp_sums[warp][lane * K + i] = sums[j][i];
    __syncthreads();
    const int64_t column = first + threadIdx.x;
    if (column < dim) {
      float total = warp_sums[0][threadIdx.x];
      for (int other = 1; other < kWarpsPerBlock; ++other) total = __fadd_rn(total, warp_sums[other][threadIdx.x]);
      partial[static_cast<int64_t>(blockIdx.x) * dim + column] = total;
    }
    __syncthreads();  // every thread has read the sums before the next span's are written
  }
}

// The fused kernel's grid: kRowsPerWarpWithWeight rows a warp, at most kMaxWeightBlocks blocks: a function of the row
// count alone.
int64_t weight_row_blocks(int64_t rows) {
  const int64_t rows_per_block = kWarpsPerBlock * kRowsPerWarpWithWeight;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return blocks < kMaxWeightBlocks ? blocks : kMaxWeightBlocks;
}

// The weight gradient's column sums, a block at a time: a block takes kColumnSpans spans of K columns and a row block
// (kRowsPerTermBlock rows of terms at the first level, kRowsPerSumBlock rows of partial sums at the later ones); row
// lane l of the block sums rows l, l + kRowLanes, ... in ascending order, then lane 0 adds the lanes' sums in lane
// order. Each level turns [rows, D] terms into [ceil(rows / rows per block), D] partial sums; the last level (one row
// block) adds its sums into dw. So every column's order of additions follows from the row count alone: neither D, nor
// K, nor the other columns change it. The first level's term is dy * (x * rstd), a later level's the partial sum.
// The first level's blocks are short so that a few thousand rows (a micro-batch of 4,096 tokens) still give every SM
// several blocks: with 256-row blocks its 2048-wide norm ran 128 blocks, 29 us a call where its bytes take ~5.
constexpr int kRowLanes = 8;
constexpr int kColumnSpans = kColumnThreads / kRowLanes;
constexpr int64_t kRowsPerTermBlock = 64;
constexpr int64_t kRowsPerSumBlock = 256;

template <int K, typename TDY, typename TX>
__device__ __forceinline__ void add_terms(float (&acc)[K], const TDY* dy, const TX* x, const float* rstd, int64_t n,
                                          int64_t offset) {
  float a[K], b[K];
  load_span<K>(dy + offset, a);
  if (rstd == nullptr) {  // a later level: the terms are the partial sums themselves
#pragma unroll
    for (int i = 0; i < K; ++i) acc[i] = __fadd_rn(acc[i], a[i]);
    return;
  }
  load_span<K>(x + offset, b);
  const float r = rstd[n];
#pragma unroll
  for (int i = 0; i < K; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(a[i], __fmul_rn(b[i], r)));
}

// out[blockIdx.y, d] (or dw[d] += , when `final`) = the block's sum over its rows of the terms at column d.
template <int K, typename TDY, typename TX>
__global__ void weight_sums_kernel(float* out, const TDY* dy, const TX* x, const float* rstd, int64_t rows, int64_t dim,
                                   int64_t rows_per_block, bool final) {
  __shared__ float lane_sums[kRowLanes][kColumnSpans * K];
  const int span = threadIdx.x % kColumnSpans, lane = threadIdx.x / kColumnSpans;
  const int64_t d = (static_cast<int64_t>(blockIdx.x) * kColumnSpans + span) * K;
  const int64_t row_blocks = (rows + rows_per_block - 1) / rows_per_block;
  for (int64_t block = blockIdx.y; block < row_blocks; block += gridDim.y) {  // grid-stride beyond 65535 blocks
    const int64_t begin = block * rows_per_block;
    const int64_t end = begin + rows_per_block < rows ? begin + rows_per_block : rows;
    float acc[K] = {};
    if (d < dim) {
#pragma unroll 4
      for (int64_t n = begin + lane; n < end; n += kRowLanes) add_terms<K>(acc, dy, x, rstd, n, n * dim + d);
    }
#pragma unroll
    for (int i = 0; i < K; ++i) lane_sums[lane][span * K + i] = acc[i];
    __syncthreads();
    if (lane == 0 && d < dim) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        float total = lane_sums[0][span * K + i];
        for (int l = 1; l < kRowLanes; ++l) total = __fadd_rn(total, lane_sums[l][span * K + i]);
        float* target = final ? out + d + i : out + block * dim + d + i;
        *target = final ? __fadd_rn(*target, total) : total;
      }
    }
    __syncthreads();  // lane 0 has read the sums before the next block's are written
  }
}

// The row blocks of a level over `rows` rows: of terms (the first, with rstd) or of partial sums.
int64_t sum_row_blocks(int64_t rows, bool terms) {
  const int64_t rows_per_block = terms ? kRowsPerTermBlock : kRowsPerSumBlock;
  return (rows + rows_per_block - 1) / rows_per_block;
}

// One level of weight_sums_kernel over `rows` rows of terms (rstd given) or of partial sums (rstd null), into dw
// (final) or into `out` [sum_row_blocks, D].
template <typename TDY, typename TX>
void launch_weight_sums(cudaStream_t stream, float* out, const TDY* dy, const TX* x, const float* rstd, int64_t rows,
                        int64_t dim, bool packed) {
  const int64_t rows_per_block = rstd != nullptr ? kRowsPerTermBlock : kRowsPerSumBlock;
  const int64_t row_blocks = sum_row_blocks(rows, rstd != nullptr);
  const int k = packed ? 8 : 1;
  const int64_t column_blocks = (dim / k + kColumnSpans - 1) / kColumnSpans;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(row_blocks < 65535 ? row_blocks : 65535));
  if (packed) {
    weight_sums_kernel<8>
        <<<grid, kColumnThreads, 0, stream>>>(out, dy, x, rstd, rows, dim, rows_per_block, row_blocks == 1);
  } else {
    weight_sums_kernel<1>
        <<<grid, kColumnThreads, 0, stream>>>(out, dy, x, rstd, rows, dim, rows_per_block, row_blocks == 1);
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  if (rows == 0) return;
  const bool packed = reduction_packs(stream, dim, 8, {y.raw_data(), x.raw_data(), w.raw_data()}, "rmsnorm_forward");
  const int lanes = row_lanes(dim, packed);
  dispatch_activations(y, x, "rmsnorm_forward", [&]<typename TY, typename TX>(TY*, TX*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      forward_kernel<Lanes><<<row_blocks(rows, Lanes), kRowThreads, 0, native(stream)>>>(
          static_cast<TY*>(y.raw_data()), static_cast<float*>(rstd.raw_data()), static_cast<const TX*>(x.raw_data()),
          static_cast<const float*>(w.raw_data()), rows, dim, params.eps, params.zero_centered, packed);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void add_rmsnorm_forward(const Stream& stream, const Tensor& sum, const Tensor& y, const Tensor& rstd, const Tensor& a,
                         const Tensor& b, const Tensor& w, const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = a.numel() / dim;
  if (rows == 0) return;
  // sum in a's dtype and y in b's (ops/norm.cpp checks it).
  const bool packed = reduction_packs(
      stream, dim, 8, {sum.raw_data(), y.raw_data(), a.raw_data(), b.raw_data(), w.raw_data()}, "add_rmsnorm_forward");
  const int lanes = row_lanes(dim, packed);
  dispatch_activations(a, b, "add_rmsnorm_forward", [&]<typename TA, typename TB>(TA*, TB*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      add_forward_kernel<Lanes><<<row_blocks(rows, Lanes), kRowThreads, 0, native(stream)>>>(
          static_cast<TA*>(sum.raw_data()), static_cast<TB*>(y.raw_data()), static_cast<float*>(rstd.raw_data()),
          static_cast<const TA*>(a.raw_data()), static_cast<const TB*>(b.raw_data()),
          static_cast<const float*>(w.raw_data()), rows, dim, params.eps, params.zero_centered, packed);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void rmsnorm_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const RmsNormParams& params, const Tensor& addend) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  if (rows == 0) return;
  // dx and the addend in x's dtype (ops/norm.cpp checks it).
  const void* addend_base = addend.defined() ? addend.raw_data() : dx.raw_data();
  const bool packed =
      reduction_packs(stream, dim, 8, {dx.raw_data(), dy.raw_data(), x.raw_data(), w.raw_data(), addend_base},
                      "rmsnorm_backward_input");
  const int lanes = row_lanes(dim, packed);
  dispatch_activations(dy, x, "rmsnorm_backward_input", [&]<typename TDY, typename TX>(TDY*, TX*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      backward_input_kernel<Lanes><<<row_blocks(rows, Lanes), kRowThreads, 0, native(stream)>>>(
          static_cast<TX*>(dx.raw_data()), static_cast<const TDY*>(dy.raw_data()), static_cast<const TX*>(x.raw_data()),
          static_cast<const float*>(w.raw_data()), static_cast<const float*>(rstd.raw_data()),
          addend.defined() ? static_cast<const TX*>(addend.raw_data()) : nullptr, rows, dim, params.zero_centered,
          packed);
    });
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void rmsnorm_backward_weight(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const Tensor& rstd) {
  const int64_t dim = dw.numel();
  int64_t rows = x.numel() / dim;
  if (rows == 0) return;  // dw += an empty sum
  const cudaStream_t cu_stream = native(stream);
  float* const dw_data = static_cast<float*>(dw.raw_data());
  // Level 1: the terms dy * xhat summed over blocks of rows; then the partial sums over blocks of theirs
  // (add_column_sums), until one block's sums go into dw.
  Tensor partial;
  dispatch_activations(dy, x, "rmsnorm_backward_weight", [&]<typename TDY, typename TX>(TDY*, TX*) {
    const int64_t row_blocks = sum_row_blocks(rows, /*terms=*/true);
    if (row_blocks > 1) partial = Tensor::empty({row_blocks, dim}, DType::F32, dw.device());
    launch_weight_sums(cu_stream, row_blocks > 1 ? static_cast<float*>(partial.raw_data()) : dw_data,
                       static_cast<const TDY*>(dy.raw_data()), static_cast<const TX*>(x.raw_data()),
                       static_cast<const float*>(rstd.raw_data()), rows, dim,
                       spans_of_8(dim, {dy.raw_data(), x.raw_data()}));
    rows = row_blocks;
  });
  if (rows > 1) add_column_sums(stream, dw, partial);
}

bool rmsnorm_backward_in_one_pass(int64_t dim) {
  return dim % 8 == 0 && row_lanes(dim, /*packed=*/true) == 32 && dim <= kMaxWeightDim;
}

void rmsnorm_backward_input_weight(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                   const Tensor& x, const Tensor& w, const Tensor& rstd, const RmsNormParams& params,
                                   const Tensor& addend) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  if (rows == 0) return;  // dw += an empty sum
  const void* addend_base = addend.defined() ? addend.raw_data() : dx.raw_data();
  const bool packed = spans_of_8(dim, {dx.raw_data(), dy.raw_data(), x.raw_data(), w.raw_data(), addend_base});
  if (!packed || !rmsnorm_backward_in_one_pass(dim)) {
    // Rows the one pass does not take: the weight gradient first, since dx may overwrite dy.
    rmsnorm_backward_weight(stream, dw, dy, x, rstd);
    rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params, addend);
    return;
  }
  const int64_t blocks = weight_row_blocks(rows);
  const Tensor partial = Tensor::empty({blocks, dim}, DType::F32, dw.device());
  dispatch_activations(dy, x, "rmsnorm_backward_input_weight", [&]<typename TDY, typename TX>(TDY*, TX*) {
    backward_input_weight_kernel<<<static_cast<unsigned>(blocks), kRowThreads, 0, native(stream)>>>(
        static_cast<TX*>(dx.raw_data()), static_cast<float*>(partial.raw_data()),
        static_cast<const TDY*>(dy.raw_data()), static_cast<const TX*>(x.raw_data()),
        static_cast<const float*>(w.raw_data()), static_cast<const float*>(rstd.raw_data()),
        addend.defined() ? static_cast<const TX*>(addend.raw_data()) : nullptr, rows, dim, params.zero_centered);
  });
  MT_CUDA_CHECK(cudaGetLastError());
  add_column_sums(stream, dw, partial);
}

void add_column_sums(const Stream& stream, const Tensor& dw, const Tensor& partial) {
  const int64_t dim = dw.numel();
  int64_t rows = partial.numel() / dim;
  Tensor sums_in = partial;
  while (rows > 0) {
    const int64_t row_blocks = sum_row_blocks(rows, /*terms=*/false);
    Tensor next = row_blocks > 1 ? Tensor::empty({row_blocks, dim}, DType::F32, dw.device()) : Tensor();
    const auto* sums = static_cast<const float*>(sums_in.raw_data());
    launch_weight_sums<float, float>(native(stream),
                                     static_cast<float*>(row_blocks > 1 ? next.raw_data() : dw.raw_data()), sums,
                                     nullptr, nullptr, rows, dim, spans_of_8(dim, {sums}));
    if (row_blocks == 1) return;
    sums_in = next;
    rows = row_blocks;
  }
}

}  // namespace moetrain::ops::cuda
