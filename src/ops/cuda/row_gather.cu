// defines: the CUDA row gather (one block per output row, threads copying the row in words of up to 16 bytes) and
// segmented row sums (one block per segment, a thread per column summing the segment's rows in order in f32). No
// atomics: every output element is written by one thread in a fixed order, whatever the grid.
#include "ops/cuda/row_gather.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/group_parts.cuh"
#include "ops/cuda/runtime.h"
#include "ops/row_gather.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;  // grid-stride over rows beyond this

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

// A word of all-one bits: what the gather writes for an index outside the input.
template <typename W>
__device__ __forceinline__ W all_ones() {
  return static_cast<W>(~W(0));
}
template <>
__device__ __forceinline__ uint4 all_ones<uint4>() {
  return make_uint4(~0u, ~0u, ~0u, ~0u);
}

// Row i of out (words_per_row words of type W) = row index[i] of in.
template <typename W>
__global__ void gather_rows_kernel(W* out, const W* in, const int32_t* index, int64_t rows, int64_t in_rows,
                                   int64_t words_per_row) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t src = index[i];
    W* y = out + i * words_per_row;
    if (src < 0 || src >= in_rows) {
      for (int64_t w = threadIdx.x; w < words_per_row; w += blockDim.x) y[w] = all_ones<W>();
      continue;
    }
    const W* x = in + src * words_per_row;
    for (int64_t w = threadIdx.x; w < words_per_row; w += blockDim.x) y[w] = x[w];
  }
}

template <typename W>
void launch_gather(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& index, size_t row_bytes) {
  const int64_t rows = out.size(0);
  gather_rows_kernel<W><<<row_blocks(rows), kThreads, 0, native(stream)>>>(
      static_cast<W*>(out.raw_data()), static_cast<const W*>(in.raw_data()),
      static_cast<const int32_t*>(index.raw_data()), rows, in.size(0), static_cast<int64_t>(row_bytes / sizeof(W)));
  MT_CUDA_CHECK(cudaGetLastError());
}

// Segment u (grid-stride over blocks): each thread owns columns threadIdx.x + k * blockDim.x and sums the segment's
// rows in ascending j, starting from the first row, in f32.
template <typename S>
__global__ void sum_rows_kernel(S* out, const S* in, const int32_t* offsets, const int32_t* rows, int64_t segments,
                                int64_t in_rows, int64_t listed, int64_t hidden) {
  const float nan = __int_as_float(0x7fc00000);
  for (int64_t u = blockIdx.x; u < segments; u += gridDim.x) {
    const int64_t begin = offsets[u], end = offsets[u + 1];
    S* y = out + u * hidden;
    bool bad = begin < 0 || end < begin || end > listed;  // not validated on the device: poison, never read outside
    for (int64_t j = begin; !bad && j < end; ++j) bad = rows[j] < 0 || rows[j] >= in_rows;
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;
      if (bad) {
        acc = nan;
      } else if (begin < end) {
        acc = load_float(in + static_cast<int64_t>(rows[begin]) * hidden + h);
        for (int64_t j = begin + 1; j < end; ++j) acc += load_float(in + static_cast<int64_t>(rows[j]) * hidden + h);
      }
      store_float(y + h, acc);
    }
  }
}

template <typename S>
void launch_sum(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& segment_offsets,
                const Tensor& segment_rows) {
  const int64_t segments = out.size(0);
  sum_rows_kernel<S><<<row_blocks(segments), kThreads, 0, native(stream)>>>(
      static_cast<S*>(out.raw_data()), static_cast<const S*>(in.raw_data()),
      static_cast<const int32_t*>(segment_offsets.raw_data()), static_cast<const int32_t*>(segment_rows.raw_data()),
      segments, in.size(0), segment_rows.numel(), out.size(1));
  MT_CUDA_CHECK(cudaGetLastError());
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One thread per token: the set of ranks its choices reach, then one integer add per rank.
__global__ void count_tokens_kernel(int32_t* counts, const int32_t* choice, int64_t tokens, int64_t k,
                                    int64_t experts_per_rank, int64_t ranks) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    uint64_t reached = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t q = choice[t * k + j] / experts_per_rank;
      if (choice[t * k + j] >= 0 && q < ranks) reached |= uint64_t(1) << q;
    }
    for (int64_t q = 0; q < ranks; ++q) {
      if (reached >> q & 1) atomicAdd(&counts[q], 1);
    }
  }
}

__global__ void concat_group_offsets_kernel(int32_t* out, GroupParts parts, int64_t bounds) {
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < bounds; g += int64_t(gridDim.x) * blockDim.x) {
    int32_t sum = 0;
    for (int q = 0; q < parts.count; ++q) sum += parts.offsets[q][g];
    out[g] = sum;
  }
}

// A warp per row (kConcatRowsPerBlock rows a block, grid-stride), each lane with kConcatLoadsInFlight words loaded
// before any is stored: a block per row with one word per thread is bound by block launches, not by HBM.
constexpr int kConcatRowsPerBlock = 8;
constexpr int kConcatLoadsInFlight = 8;

template <typename W>
__global__ void __launch_bounds__(32 * kConcatRowsPerBlock)
    concat_group_rows_kernel(W* out, const W* in, GroupParts parts, int part, int64_t groups, int64_t rows,
                             int64_t out_rows, int64_t words_per_row) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x * int64_t(kConcatRowsPerBlock) + warp; r < rows;
       r += int64_t(gridDim.x) * kConcatRowsPerBlock) {
    const int64_t dest = concat_destination(parts, part, groups, r);
    if (dest < 0 || dest >= out_rows) continue;  // bad offsets: never write outside out
    const W* x = in + r * words_per_row;
    W* y = out + dest * words_per_row;
    for (int64_t base = 0; base < words_per_row; base += 32 * kConcatLoadsInFlight) {
      W v[kConcatLoadsInFlight];
#pragma unroll
      for (int k = 0; k < kConcatLoadsInFlight; ++k) {
        const int64_t w = base + k * 32 + lane;
        if (w < words_per_row) v[k] = x[w];
      }
#pragma unroll
      for (int k = 0; k < kConcatLoadsInFlight; ++k) {
        const int64_t w = base + k * 32 + lane;
        if (w < words_per_row) y[w] = v[k];
      }
    }
  }
}

template <typename W>
void launch_concat(const Stream& stream, const Tensor& out, const std::vector<Tensor>& parts, const GroupParts& table,
                   int64_t groups, size_t row_bytes) {
  for (int p = 0; p < table.count; ++p) {
    const Tensor& part = parts[static_cast<size_t>(p)];
    if (part.size(0) == 0) continue;
    const int64_t blocks = (part.size(0) + kConcatRowsPerBlock - 1) / kConcatRowsPerBlock;
    concat_group_rows_kernel<W><<<row_blocks(blocks), 32 * kConcatRowsPerBlock, 0, native(stream)>>>(
        static_cast<W*>(out.raw_data()), static_cast<const W*>(part.raw_data()), table, p, groups, part.size(0),
        out.size(0), static_cast<int64_t>(row_bytes / sizeof(W)));
    MT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void concat_group_offsets(const Stream& stream, const Tensor& out_offsets, const std::vector<Tensor>& offsets) {
  const int64_t bounds = out_offsets.numel();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((bounds + kThreads - 1) / kThreads, 1024));
  concat_group_offsets_kernel<<<blocks, kThreads, 0, native(stream)>>>(static_cast<int32_t*>(out_offsets.raw_data()),
                                                                       group_parts(offsets), bounds);
  MT_CUDA_CHECK(cudaGetLastError());
}

void concat_group_rows(const Stream& stream, const Tensor& out, const std::vector<Tensor>& parts,
                       const std::vector<Tensor>& offsets) {
  const size_t row_bytes = static_cast<size_t>(out.size(1)) * dtype_size(out.dtype());
  if (out.size(0) == 0 || row_bytes == 0) return;
  const GroupParts table = group_parts(offsets);
  const int64_t groups = offsets[0].numel() - 1;
  // The widest word that divides the row and to which every base pointer is aligned (rows then are too).
  auto fits = [&](size_t word) {
    if (row_bytes % word != 0 || !aligned(out.raw_data(), word)) return false;
    for (const Tensor& part : parts) {
      if (!aligned(part.raw_data(), word)) return false;
    }
    return true;
  };
  if (fits(16)) {
    launch_concat<uint4>(stream, out, parts, table, groups, row_bytes);
  } else if (fits(8)) {
    launch_concat<uint64_t>(stream, out, parts, table, groups, row_bytes);
  } else if (fits(4)) {
    launch_concat<uint32_t>(stream, out, parts, table, groups, row_bytes);
  } else if (fits(2)) {
    launch_concat<uint16_t>(stream, out, parts, table, groups, row_bytes);
  } else {
    launch_concat<uint8_t>(stream, out, parts, table, groups, row_bytes);
  }
}

void gather_rows(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& index) {
  const size_t row_bytes = static_cast<size_t>(out.size(1)) * dtype_size(out.dtype());
  if (out.size(0) == 0 || row_bytes == 0) return;
  // The widest word that divides the row and to which both base pointers are aligned (rows then are too).
  auto fits = [&](size_t word) {
    return row_bytes % word == 0 && aligned(out.raw_data(), word) && aligned(in.raw_data(), word);
  };
  if (fits(16)) {
    launch_gather<uint4>(stream, out, in, index, row_bytes);
  } else if (fits(8)) {
    launch_gather<uint64_t>(stream, out, in, index, row_bytes);
  } else if (fits(4)) {
    launch_gather<uint32_t>(stream, out, in, index, row_bytes);
  } else if (fits(2)) {
    launch_gather<uint16_t>(stream, out, in, index, row_bytes);
  } else {
    launch_gather<uint8_t>(stream, out, in, index, row_bytes);
  }
}

void sum_rows(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& segment_offsets,
              const Tensor& segment_rows) {
  if (out.numel() == 0) return;
  switch (out.dtype()) {
    case DType::F32: launch_sum<float>(stream, out, in, segment_offsets, segment_rows); return;
    case DType::BF16: launch_sum<__nv_bfloat16>(stream, out, in, segment_offsets, segment_rows); return;
    default: MT_FAIL("sum_rows (CUDA): expected out in f32 or bf16 but found {}", out.describe());
  }
}

void count_tokens_per_rank(const Stream& stream, const Tensor& counts, const Tensor& topk_index,
                           int64_t experts_per_rank) {
  MT_CUDA_CHECK(cudaMemsetAsync(counts.raw_data(), 0, counts.nbytes(), native(stream)));
  const int64_t tokens = topk_index.size(0);
  if (tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((tokens + kThreads - 1) / kThreads, 4096));
  count_tokens_kernel<<<blocks, kThreads, 0, native(stream)>>>(
      counts.data<int32_t>(), topk_index.data<int32_t>(), tokens, topk_index.size(1), experts_per_rank, counts.numel());
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
