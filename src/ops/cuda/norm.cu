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
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kRowThreads = 32 * kWarpsPerBlock;
constexpr int kColumnThreads = 256;
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

// The value a T element holds after store_float: f32 as is, bf16 rounded to nearest even.
__device__ __forceinline__ float stored_value(float v, const float*) { return v; }
__device__ __forceinline__ float stored_value(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
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

// Every lane reads all of its dy elements for the sum before the butterfly, which no lane leaves before all have
// entered it; then each lane rewrites only its own elements: dx may alias dy.
template <int K, int Lanes, typename TDX, typename TDY, typename TX>
__device__ void backward_input_rows(TDX* dx, const TDY* dy, const TX* x, const float* w, const float* rstd,
                                    int64_t rows, int64_t dim, bool zero_centered) {
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
      store_span<K>(dxr + d, g);
    }
  });
}

template <int Lanes, typename TDX, typename TDY, typename TX>
__global__ void backward_input_kernel(TDX* dx, const TDY* dy, const TX* x, const float* w, const float* rstd,
                                      int64_t rows, int64_t dim, bool zero_centered, bool packed) {
  if (packed) {
    backward_input_rows<8, Lanes>(dx, dy, x, w, rstd, rows, dim, zero_centered);
  } else {
    backward_input_rows<1, Lanes>(dx, dy, x, w, rstd, rows, dim, zero_centered);
  }
}

// The weight gradient's column sums, a block at a time: a block takes kColumnSpans spans of K columns and
// kRowsPerSumBlock rows; row lane l of the block sums rows l, l + kRowLanes, ... in ascending order, then lane 0 adds
// the lanes' sums in lane order. Each level turns [rows, D] terms into [ceil(rows / kRowsPerSumBlock), D] partial
// sums; the last level (one row block) adds its sums into dw. So every column's order of additions follows from the
// row count alone: neither D, nor K, nor the other columns change it. The first level's term is dy * (x * rstd), a
// later level's the partial sum.
constexpr int kRowLanes = 8;
constexpr int kColumnSpans = kColumnThreads / kRowLanes;
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
                                   bool final) {
  __shared__ float lane_sums[kRowLanes][kColumnSpans * K];
  const int span = threadIdx.x % kColumnSpans, lane = threadIdx.x / kColumnSpans;
  const int64_t d = (static_cast<int64_t>(blockIdx.x) * kColumnSpans + span) * K;
  const int64_t row_blocks = (rows + kRowsPerSumBlock - 1) / kRowsPerSumBlock;
  for (int64_t block = blockIdx.y; block < row_blocks; block += gridDim.y) {  // grid-stride beyond 65535 blocks
    const int64_t begin = block * kRowsPerSumBlock;
    const int64_t end = begin + kRowsPerSumBlock < rows ? begin + kRowsPerSumBlock : rows;
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

// One level of weight_sums_kernel over `rows` rows of terms, into dw (final) or into `out` [row blocks, D].
template <typename TDY, typename TX>
void launch_weight_sums(cudaStream_t stream, float* out, const TDY* dy, const TX* x, const float* rstd, int64_t rows,
                        int64_t dim, bool packed) {
  const int64_t row_blocks = (rows + kRowsPerSumBlock - 1) / kRowsPerSumBlock;
  const int k = packed ? 8 : 1;
  const int64_t column_blocks = (dim / k + kColumnSpans - 1) / kColumnSpans;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(row_blocks < 65535 ? row_blocks : 65535));
  if (packed) {
    weight_sums_kernel<8><<<grid, kColumnThreads, 0, stream>>>(out, dy, x, rstd, rows, dim, row_blocks == 1);
  } else {
    weight_sums_kernel<1><<<grid, kColumnThreads, 0, stream>>>(out, dy, x, rstd, rows, dim, row_blocks == 1);
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

unsigned row_blocks(int64_t rows, int lanes) {
  const int64_t rows_per_block = int64_t{kWarpsPerBlock} * (32 / lanes);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// The lanes a row of `dim` elements takes in spans of 8 (`packed`) or 1 (RowLanes).
int row_lanes(int64_t dim, bool packed) {
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
                            const Tensor& rstd, const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  if (rows == 0) return;
  // dx in x's dtype (ops/norm.cpp checks it).
  const bool packed = reduction_packs(stream, dim, 8, {dx.raw_data(), dy.raw_data(), x.raw_data(), w.raw_data()},
                                      "rmsnorm_backward_input");
  const int lanes = row_lanes(dim, packed);
  dispatch_activations(dy, x, "rmsnorm_backward_input", [&]<typename TDY, typename TX>(TDY*, TX*) {
    with_row_lanes(lanes, [&]<int Lanes>() {
      backward_input_kernel<Lanes><<<row_blocks(rows, Lanes), kRowThreads, 0, native(stream)>>>(
          static_cast<TX*>(dx.raw_data()), static_cast<const TDY*>(dy.raw_data()), static_cast<const TX*>(x.raw_data()),
          static_cast<const float*>(w.raw_data()), static_cast<const float*>(rstd.raw_data()), rows, dim,
          params.zero_centered, packed);
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
  // Level 1: the terms dy * xhat summed over blocks of rows; then the partial sums over blocks of theirs, until one
  // block's sums go into dw.
  Tensor partial;
  dispatch_activations(dy, x, "rmsnorm_backward_weight", [&]<typename TDY, typename TX>(TDY*, TX*) {
    const int64_t row_blocks = (rows + kRowsPerSumBlock - 1) / kRowsPerSumBlock;
    if (row_blocks > 1) partial = Tensor::empty({row_blocks, dim}, DType::F32, dw.device());
    launch_weight_sums(cu_stream, row_blocks > 1 ? static_cast<float*>(partial.raw_data()) : dw_data,
                       static_cast<const TDY*>(dy.raw_data()), static_cast<const TX*>(x.raw_data()),
                       static_cast<const float*>(rstd.raw_data()), rows, dim,
                       spans_of_8(dim, {dy.raw_data(), x.raw_data()}));
    rows = row_blocks;
  });
  while (rows > 1) {
    const int64_t row_blocks = (rows + kRowsPerSumBlock - 1) / kRowsPerSumBlock;
    Tensor next = row_blocks > 1 ? Tensor::empty({row_blocks, dim}, DType::F32, dw.device()) : Tensor();
    const auto* sums = static_cast<const float*>(partial.raw_data());
    launch_weight_sums<float, float>(cu_stream, row_blocks > 1 ? static_cast<float*>(next.raw_data()) : dw_data, sums,
                                     nullptr, nullptr, rows, dim, spans_of_8(dim, {sums}));
    partial = next;
    rows = row_blocks;
  }
}

}  // namespace moetrain::ops::cuda
