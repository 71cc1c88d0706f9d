// defines: the grouped GEMM kernels. Row kernels (forward, backward input): each block owns a tile of up to 64 rows
// of ONE group x 64 output columns. Tiles are numbered group after group (ceil(rows_g / 64) tiles for group g), so
// no tile straddles a group boundary; the grid holds ceil(R / 64) + G row tiles, an upper bound of that count known
// on the host without reading the offsets, and each block finds its group with a warp-wide scan of the per-group
// tile counts (read from the device offsets) while the surplus blocks exit. Weight kernel (backward weight): one
// block per (group, 64 x 64 tile of dw[g]) loops over the group's rows in ascending order. Both stage operands in
// shared memory in 32-deep slices along the reduction, converted to f32; every output element is one f32 fma chain
// in ascending reduction order, whatever its tile, so results are deterministic and batch-invariant.
#include "ops/cuda/grouped_gemm.h"

#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kTileRows = 64;   // rows of a block's output tile (rows of x / dy, or n of dw)
constexpr int kTileCols = 64;   // columns of a block's output tile
constexpr int kTileDepth = 32;  // reduction slice staged in shared memory per step
constexpr int kThreadsX = 16;   // a block is 16 x 16 threads ...
constexpr int kThreadsY = 16;
constexpr int kThreads = kThreadsX * kThreadsY;
constexpr int kPerThread = 4;  // ... each computing 4 x 4 outputs, strided by 16 in both directions
constexpr int kMaxGridYZ = 65535;
static_assert(kTileRows == kThreadsY * kPerThread && kTileCols == kThreadsX * kPerThread);
static_assert(kTileRows * kTileDepth % kThreads == 0 && kTileCols * kTileDepth % kThreads == 0);

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Group g's rows [begin, end), clamped into [0, rows] so that malformed offsets (not checked for device tensors)
// cannot send a kernel out of bounds.
__device__ __forceinline__ void group_range(const int32_t* offsets, int g, int rows, int* begin, int* end) {
  const int b = min(max(offsets[g], 0), rows);
  const int e = min(max(offsets[g + 1], 0), rows);
  *begin = b;
  *end = max(e, b);
}

// Row kernel. out[r, c] = sum_j a[r, j] * B_g(j, c) over j ascending, g the group of row r, a [R, J] row-major,
// w [G, ...] and out [R, C] row-major. kWeightIsCJ: w[g] is stored [C, J] (forward: B_g(j, c) = w[g][c][j]);
// otherwise [J, C] (backward input: B_g(j, c) = w[g][j][c]).
template <typename T, bool kWeightIsCJ>
__global__ void __launch_bounds__(kThreads)
    grouped_rows_kernel(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ w,
                        const int32_t* __restrict__ offsets, int groups, int rows, int depth, int cols) {
  __shared__ float a_tile[kTileDepth][kTileRows + 1];  // [j][row]; +1 keeps the transposing stores conflict-free
  __shared__ float b_tile[kTileDepth][kTileCols + 1];  // [j][col]
  __shared__ int s_group, s_begin, s_end;
  const int tid = threadIdx.y * kThreadsX + threadIdx.x;
  const int tile = static_cast<int>(blockIdx.x);

  if (tid == 0) s_group = -1;
  __syncthreads();
  if (tid < 32) {  // warp 0: scan the per-group tile counts 32 groups at a time
    const unsigned kFull = 0xffffffffu;
    const int lane = tid;
    int before = 0;  // tiles of the groups already scanned
    for (int base = 0; base < groups; base += 32) {
      const int g = base + lane;
      int begin = 0, end = 0;
      if (g < groups) group_range(offsets, g, rows, &begin, &end);
      const int count = (end - begin + kTileRows - 1) / kTileRows;
      int inclusive = count;
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(kFull, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      const int total = __shfl_sync(kFull, inclusive, 31);
      if (tile < before + total) {  // warp-uniform: the tile belongs to one of these 32 groups
        const unsigned holders = __ballot_sync(kFull, tile < before + inclusive);
        if (lane == __ffs(holders) - 1) {
          const int first = begin + (tile - before - (inclusive - count)) * kTileRows;
          s_group = g;
          s_begin = first;
          s_end = min(end, first + kTileRows);
        }
        break;
      }
      before += total;
    }
  }
  __syncthreads();
  const int g = s_group;
  if (g < 0) return;  // a surplus tile: the grid's bound exceeds the actual tile count
  const int row_begin = s_begin;
  const int tile_rows = s_end - s_begin;
  const int col_begin = static_cast<int>(blockIdx.y) * kTileCols;
  const T* wg = w + static_cast<int64_t>(g) * cols * depth;
  const T* a_rows = a + static_cast<int64_t>(row_begin) * depth;

  float acc[kPerThread][kPerThread] = {};
  for (int j0 = 0; j0 < depth; j0 += kTileDepth) {
    // a slice: 64 rows x 32 j; 32 consecutive threads read one row's 32 consecutive elements.
#pragma unroll
    for (int i = 0; i < kTileRows * kTileDepth / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int r = e / kTileDepth, jj = e % kTileDepth;
      const int j = j0 + jj;
      a_tile[jj][r] = (r < tile_rows && j < depth) ? to_float(a_rows[static_cast<int64_t>(r) * depth + j]) : 0.0f;
    }
    // w slice: 32 j x 64 columns, read along its contiguous dimension.
#pragma unroll
    for (int i = 0; i < kTileCols * kTileDepth / kThreads; ++i) {
      const int e = tid + i * kThreads;
      if constexpr (kWeightIsCJ) {
        const int c = e / kTileDepth, jj = e % kTileDepth;
        const int col = col_begin + c, j = j0 + jj;
        b_tile[jj][c] = (col < cols && j < depth) ? to_float(wg[static_cast<int64_t>(col) * depth + j]) : 0.0f;
      } else {
        const int jj = e / kTileCols, c = e % kTileCols;
        const int col = col_begin + c, j = j0 + jj;
        b_tile[jj][c] = (col < cols && j < depth) ? to_float(wg[static_cast<int64_t>(j) * cols + col]) : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int jj = 0; jj < kTileDepth; ++jj) {
      float av[kPerThread], bv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) av[i] = a_tile[jj][threadIdx.y + i * kThreadsY];
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) bv[k] = b_tile[jj][threadIdx.x + k * kThreadsX];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) acc[i][k] = fmaf(av[i], bv[k], acc[i][k]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int r = threadIdx.y + i * kThreadsY;
    if (r >= tile_rows) continue;
    T* out_row = out + static_cast<int64_t>(row_begin + r) * cols;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int col = col_begin + threadIdx.x + k * kThreadsX;
      if (col < cols) out_row[col] = from_float<T>(acc[i][k]);
    }
  }
}

// Weight kernel. dw[g][n][k] += sum_r dy[r][n] * x[r][k] over the group's rows r ascending; block (k tile, n tile,
// g). dy [R, N], x [R, K] row-major, dw [G, N, K] f32.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grouped_weight_kernel(float* __restrict__ dw, const T* __restrict__ dy, const T* __restrict__ x,
                          const int32_t* __restrict__ offsets, int rows, int n_out, int n_in) {
  __shared__ float dy_tile[kTileDepth][kTileRows];  // [row][n]
  __shared__ float x_tile[kTileDepth][kTileCols];   // [row][k]
  const int g = static_cast<int>(blockIdx.z);
  int begin = 0, end = 0;
  group_range(offsets, g, rows, &begin, &end);
  if (begin == end) return;  // an empty group adds nothing
  const int tid = threadIdx.y * kThreadsX + threadIdx.x;
  const int n_begin = static_cast<int>(blockIdx.y) * kTileRows;
  const int k_begin = static_cast<int>(blockIdx.x) * kTileCols;

  float acc[kPerThread][kPerThread] = {};
  for (int r0 = begin; r0 < end; r0 += kTileDepth) {
    // 32 rows x 64 columns of dy and of x, 64 consecutive threads along one row's contiguous columns.
#pragma unroll
    for (int i = 0; i < kTileRows * kTileDepth / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int rr = e / kTileRows, c = e % kTileRows;
      const int r = r0 + rr, n = n_begin + c;
      dy_tile[rr][c] = (r < end && n < n_out) ? to_float(dy[static_cast<int64_t>(r) * n_out + n]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kTileCols * kTileDepth / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int rr = e / kTileCols, c = e % kTileCols;
      const int r = r0 + rr, k = k_begin + c;
      x_tile[rr][c] = (r < end && k < n_in) ? to_float(x[static_cast<int64_t>(r) * n_in + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int rr = 0; rr < kTileDepth; ++rr) {
      float av[kPerThread], bv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) av[i] = dy_tile[rr][threadIdx.y + i * kThreadsY];
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) bv[k] = x_tile[rr][threadIdx.x + k * kThreadsX];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) acc[i][k] = fmaf(av[i], bv[k], acc[i][k]);
      }
    }
    __syncthreads();
  }
  float* dwg = dw + static_cast<int64_t>(g) * n_out * n_in;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int n = n_begin + threadIdx.y + i * kThreadsY;
    if (n >= n_out) continue;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int col = k_begin + threadIdx.x + k * kThreadsX;
      if (col < n_in) dwg[static_cast<int64_t>(n) * n_in + col] += acc[i][k];
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_int_range(int64_t value, const char* op, const char* what) {
  MT_CHECK(value <= INT_MAX, "{} (CUDA): {} = {} exceeds the kernels' 32-bit index range", op, what, value);
}

// Launches the row kernel for out [R, C] = a [R, J] * B_g.
template <bool kWeightIsCJ>
void launch_rows(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& w, const Tensor& offsets,
                 int64_t depth, int64_t cols, const char* op) {
  const int64_t rows = a.size(0), groups = w.size(0);
  if (rows == 0 || cols == 0) return;
  check_int_range(rows, op, "rows R");
  check_int_range(depth, op, "reduction length");
  check_int_range(cols, op, "output columns");
  const int64_t row_tiles = ceil_div(rows, kTileRows) + groups;
  check_int_range(row_tiles, op, "row tiles");
  const int64_t col_tiles = ceil_div(cols, kTileCols);
  MT_CHECK(col_tiles <= kMaxGridYZ, "{} (CUDA): {} output columns need {} column tiles, more than the grid's {}", op,
           cols, col_tiles, kMaxGridYZ);
  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const dim3 block(kThreadsX, kThreadsY);
  const auto* off = offsets.data<int32_t>();
  const int g = static_cast<int>(groups), r = static_cast<int>(rows), j = static_cast<int>(depth),
            c = static_cast<int>(cols);
  switch (a.dtype()) {
    case DType::F32:
      grouped_rows_kernel<float, kWeightIsCJ>
          <<<grid, block, 0, cu_stream>>>(static_cast<float*>(out.raw_data()), static_cast<const float*>(a.raw_data()),
                                          static_cast<const float*>(w.raw_data()), off, g, r, j, c);
      break;
    case DType::BF16:
      grouped_rows_kernel<__nv_bfloat16, kWeightIsCJ><<<grid, block, 0, cu_stream>>>(
          static_cast<__nv_bfloat16*>(out.raw_data()), static_cast<const __nv_bfloat16*>(a.raw_data()),
          static_cast<const __nv_bfloat16*>(w.raw_data()), off, g, r, j, c);
      break;
    default: MT_FAIL("{} (CUDA): expected f32 or bf16 operands but found {}", op, a.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void grouped_linear_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                            const Tensor& offsets) {
  // y [R, N]: reduction over K (w[g] stored [N, K] = [C, J]).
  launch_rows<true>(stream, y, x, w, offsets, /*depth=*/w.size(2), /*cols=*/w.size(1), "grouped_linear_forward");
}

void grouped_linear_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets) {
  // dx [R, K]: reduction over N (w[g] stored [N, K] = [J, C]).
  launch_rows<false>(stream, dx, dy, w, offsets, /*depth=*/w.size(1), /*cols=*/w.size(2),
                     "grouped_linear_backward_input");
}

void grouped_linear_backward_weight(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const Tensor& offsets) {
  constexpr const char* op = "grouped_linear_backward_weight";
  const int64_t groups = dw.size(0), n_out = dw.size(1), n_in = dw.size(2), rows = x.size(0);
  if (groups == 0 || n_out == 0 || n_in == 0 || rows == 0) return;
  check_int_range(rows, op, "rows R");
  MT_CHECK(groups <= kMaxGridYZ, "{} (CUDA): {} groups exceed the grid's {}", op, groups, kMaxGridYZ);
  const int64_t n_tiles = ceil_div(n_out, kTileRows), k_tiles = ceil_div(n_in, kTileCols);
  MT_CHECK(n_tiles <= kMaxGridYZ, "{} (CUDA): N = {} needs {} tiles, more than the grid's {}", op, n_out, n_tiles,
           kMaxGridYZ);
  check_int_range(k_tiles, op, "K tiles");
  check_int_range(n_out, op, "N");
  check_int_range(n_in, op, "K");
  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const dim3 grid(static_cast<unsigned>(k_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(groups));
  const dim3 block(kThreadsX, kThreadsY);
  const auto* off = offsets.data<int32_t>();
  auto* dwp = dw.data<float>();
  const int r = static_cast<int>(rows), n = static_cast<int>(n_out), k = static_cast<int>(n_in);
  switch (dy.dtype()) {
    case DType::F32:
      grouped_weight_kernel<float><<<grid, block, 0, cu_stream>>>(
          dwp, static_cast<const float*>(dy.raw_data()), static_cast<const float*>(x.raw_data()), off, r, n, k);
      break;
    case DType::BF16:
      grouped_weight_kernel<__nv_bfloat16>
          <<<grid, block, 0, cu_stream>>>(dwp, static_cast<const __nv_bfloat16*>(dy.raw_data()),
                                          static_cast<const __nv_bfloat16*>(x.raw_data()), off, r, n, k);
      break;
    default: MT_FAIL("{} (CUDA): expected f32 or bf16 dy and x but found {}", op, dy.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
