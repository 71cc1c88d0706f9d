// defines: the CUDA bias kernels (ops/cuda/bias.h). The add gives each thread a column over a stride of rows (and one
// block per row for the grouped form, which finds the row's group by a binary search over the offsets). The gradient
// runs in two passes with no atomics: pass 1 gives every (chunk, column) one thread that sums the chunk's rows of that
// column in ascending order into a partial buffer; pass 2 gives every (group, column) one thread that adds its group's
// chunk sums in ascending order and then adds the total to dbias. Group g's chunks are rows [b + j C, b + (j + 1) C) of
// its rows [b, e) (C = kBiasRowsPerChunk) and live in partial slots floor(b / C) + g + j: the slots of different groups
// never overlap and all lie below floor(R / C) + G, so the buffer's size is known on the host without reading the
// offsets.
#include "ops/cuda/bias.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this
constexpr int64_t kMaxGridY = 65535;              // likewise for the second grid dimension
constexpr int64_t kChunk = kBiasRowsPerChunk;

// offsets[i] clamped into [0, rows] (the values are not validated for device tensors).
__device__ __forceinline__ int64_t clamped_offset(const int32_t* offsets, int64_t i, int64_t rows) {
  const int64_t v = offsets[i];
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// Group g's rows [begin, end) (end >= begin even for malformed offsets) and its first partial slot. Without offsets
// there is one group, all rows.
struct GroupRows {
  int64_t begin, end, first_slot;
};

__device__ __forceinline__ GroupRows group_rows(const int32_t* offsets, int64_t g, int64_t rows) {
  if (offsets == nullptr) return {0, rows, 0};
  const int64_t begin = clamped_offset(offsets, g, rows);
  const int64_t end = clamped_offset(offsets, g + 1, rows);
  return {begin, end > begin ? end : begin, begin / kChunk + g};
}

// The largest g in [0, groups) whose key(g) <= x (key non-decreasing for well-formed offsets; for malformed ones
// some g in range).
template <typename Key>
__device__ __forceinline__ int64_t last_at_or_below(int64_t groups, int64_t x, Key key) {
  int64_t lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (key(mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One thread per column of a block of rows (grid-stride over the rows): the bias element is read once.
template <typename T, typename B>
__global__ void add_kernel(T* y, const B* bias, int64_t rows, int64_t width) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= width) return;
  const float b = load_float(bias + n);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    store_float(y + r * width + n, load_float(y + r * width + n) + b);
}

// One block per row (grid-stride): the row's group is the last g with offsets[g] <= r, which skips empty groups.
template <typename T, typename B>
__global__ void grouped_add_kernel(T* y, const B* bias, const int32_t* offsets, int64_t groups, int64_t rows,
                                   int64_t width) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t g = last_at_or_below(groups, r, [&](int64_t i) { return clamped_offset(offsets, i, rows); });
    T* row = y + r * width;
    const B* b = bias + g * width;
    for (int64_t n = threadIdx.x; n < width; n += blockDim.x)
      store_float(row + n, load_float(row + n) + load_float(b + n));
  }
}

// Pass 1: partial[s, n] = the ascending sum of dy[r, n] over the rows of the chunk stored in slot s. A slot that
// belongs to no chunk is left unwritten (pass 2 never reads it).
template <typename T>
__global__ void chunk_sums_kernel(float* __restrict__ partial, const T* __restrict__ dy, const int32_t* offsets,
                                  int64_t groups, int64_t rows, int64_t width, int64_t slots) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= width) return;
  for (int64_t s = blockIdx.y; s < slots; s += gridDim.y) {
    const int64_t g = offsets == nullptr ? 0 : last_at_or_below(groups, s, [&](int64_t i) {
      return group_rows(offsets, i, rows).first_slot;
    });
    const GroupRows group = group_rows(offsets, g, rows);
    const int64_t j = s - group.first_slot;
    const int64_t begin = group.begin + j * kChunk;
    if (j < 0 || begin >= group.end) continue;
    const int64_t end = begin + kChunk < group.end ? begin + kChunk : group.end;
    float acc = 0.0f;
#pragma unroll 8
    for (int64_t r = begin; r < end; ++r) acc += load_float(dy + r * width + n);
    partial[s * width + n] = acc;
  }
}

// Pass 2: dbias[g, n] += the ascending sum of group g's chunk sums; an empty group adds nothing.
__global__ void group_totals_kernel(float* __restrict__ dbias, const float* __restrict__ partial,
                                    const int32_t* offsets, int64_t groups, int64_t rows, int64_t width) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= width) return;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const GroupRows group = group_rows(offsets, g, rows);
    if (group.end == group.begin) continue;
    const int64_t chunks = (group.end - group.begin + kChunk - 1) / kChunk;
    float total = 0.0f;
    for (int64_t j = 0; j < chunks; ++j) total += partial[(group.first_slot + j) * width + n];
    dbias[g * width + n] += total;
  }
}

// Blocks over the columns, one thread each (no grid-stride: 2^31 - 1 blocks cover any row that fits in memory).
unsigned column_blocks(int64_t width, int64_t threads_per_block) {
  return static_cast<unsigned>((width + threads_per_block - 1) / threads_per_block);
}

unsigned grid_y(int64_t n) { return static_cast<unsigned>(n < kMaxGridY ? n : kMaxGridY); }

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }

// Calls f(T*, B*) with y's element type T (f32 or bf16) and the bias's B (f32 or T).
template <typename F>
void dispatch_bias(const Tensor& y, const Tensor& bias, const char* op, F&& f) {
  if (y.dtype() == DType::F32 && bias.dtype() == DType::F32) {
    f(static_cast<float*>(nullptr), static_cast<const float*>(nullptr));
  } else if (y.dtype() == DType::BF16 && bias.dtype() == DType::F32) {
    f(static_cast<__nv_bfloat16*>(nullptr), static_cast<const float*>(nullptr));
  } else if (y.dtype() == DType::BF16 && bias.dtype() == DType::BF16) {
    f(static_cast<__nv_bfloat16*>(nullptr), static_cast<const __nv_bfloat16*>(nullptr));
  } else {
    MT_FAIL("{} (CUDA): expected y in f32 or bf16 and bias in f32 or y's dtype but found y {} and bias {}", op,
            y.describe(), bias.describe());
  }
}

// The two passes over dy [R, N] for `groups` groups (offsets nullptr: one group of all rows).
void column_sums(const Stream& stream, const Tensor& dbias, const Tensor& dy, const int32_t* offsets, int64_t groups,
                 const char* op) {
  const int64_t rows = dy.size(0), width = dy.size(1);
  // No rows or no groups (well-formed offsets then have R = 0): every group is empty, nothing is added.
  if (rows == 0 || width == 0 || groups == 0) return;
  const int64_t slots = offsets == nullptr ? (rows + kChunk - 1) / kChunk : rows / kChunk + groups;
  Tensor partial = Tensor::empty({slots, width}, DType::F32, dy.device());
  const unsigned blocks_x = column_blocks(width, kThreads);
  const cudaStream_t s = native(stream);
  switch (dy.dtype()) {
    case DType::F32:
      chunk_sums_kernel<<<dim3(blocks_x, grid_y(slots)), kThreads, 0, s>>>(static_cast<float*>(partial.raw_data()),
                                                                           static_cast<const float*>(dy.raw_data()),
                                                                           offsets, groups, rows, width, slots);
      break;
    case DType::BF16:
      chunk_sums_kernel<<<dim3(blocks_x, grid_y(slots)), kThreads, 0, s>>>(
          static_cast<float*>(partial.raw_data()), static_cast<const __nv_bfloat16*>(dy.raw_data()), offsets, groups,
          rows, width, slots);
      break;
    default: MT_FAIL("{} (CUDA): expected dy in f32 or bf16 but found {}", op, dy.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
  group_totals_kernel<<<dim3(blocks_x, grid_y(groups)), kThreads, 0, s>>>(static_cast<float*>(dbias.raw_data()),
                                                                          static_cast<const float*>(partial.raw_data()),
                                                                          offsets, groups, rows, width);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void bias_add(const Stream& stream, const Tensor& y, const Tensor& bias) {
  const int64_t rows = y.size(0), width = y.size(1);
  if (rows == 0 || width == 0) return;
  // Narrow rows (router logits, E columns) take blocks of whole warps just wide enough.
  const int64_t threads = width < kThreads ? (width + 31) / 32 * 32 : kThreads;
  dispatch_bias(y, bias, "bias_add", [&]<typename T, typename B>(T*, const B*) {
    add_kernel<<<dim3(column_blocks(width, threads), grid_y(rows)), static_cast<unsigned>(threads), 0,
                 native(stream)>>>(static_cast<T*>(y.raw_data()), static_cast<const B*>(bias.raw_data()), rows, width);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void bias_backward(const Stream& stream, const Tensor& dbias, const Tensor& dy) {
  column_sums(stream, dbias, dy, nullptr, 1, "bias_backward");
}

void grouped_bias_add(const Stream& stream, const Tensor& y, const Tensor& bias, const Tensor& offsets) {
  const int64_t rows = y.size(0), width = y.size(1), groups = bias.size(0);
  if (rows == 0 || width == 0 || groups == 0) return;  // G = 0: well-formed offsets have R = 0
  dispatch_bias(y, bias, "grouped_bias_add", [&]<typename T, typename B>(T*, const B*) {
    const unsigned blocks = static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
    grouped_add_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<T*>(y.raw_data()),
                                                                static_cast<const B*>(bias.raw_data()),
                                                                offsets.data<int32_t>(), groups, rows, width);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void grouped_bias_backward(const Stream& stream, const Tensor& dbias, const Tensor& dy, const Tensor& offsets) {
  column_sums(stream, dbias, dy, offsets.data<int32_t>(), dbias.size(0), "grouped_bias_backward");
}

}  // namespace moetrain::ops::cuda
