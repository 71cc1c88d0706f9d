// defines: the CUDA column-block moves: a thread per destination element (or 16-byte chunk, where the blocks allow),
// copying it, or summing its repeat source rows in ascending order in f32 (no atomics: each output is written by one
// thread in a fixed order).
#include "ops/cuda/columns.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/dtype.h"
#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream_handle(stream)); }
unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

template <typename T>
__global__ void copy_columns_kernel(T* dst, int64_t dst_cols, int64_t dst_col, const T* src, int64_t src_cols,
                                    int64_t src_col, int64_t rows, int64_t width, int64_t repeat) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, j = i % width;
    dst[r * dst_cols + dst_col + j] = src[(r / repeat) * src_cols + src_col + j];
  }
}

template <typename T>
__global__ void sum_repeated_columns_kernel(T* dst, int64_t dst_cols, int64_t dst_col, const T* src, int64_t src_cols,
                                            int64_t src_col, int64_t rows, int64_t width, int64_t repeat) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, j = i % width;
    float acc = load_float(src + (r * repeat) * src_cols + src_col + j);
    for (int64_t k = 1; k < repeat; ++k) acc += load_float(src + (r * repeat + k) * src_cols + src_col + j);
    store_float(dst + r * dst_cols + dst_col + j, acc);
  }
}

// The copy over rows of dst_cols (src_cols) elements of T, columns and width in elements of T.
template <typename T>
void launch_copy(const Stream& stream, void* dst, int64_t dst_cols, int64_t dst_col, const void* src, int64_t src_cols,
                 int64_t src_col, int64_t rows, int64_t width, int64_t repeat) {
  copy_columns_kernel<T><<<blocks_for(rows * width), kThreads, 0, native(stream)>>>(
      static_cast<T*>(dst), dst_cols, dst_col, static_cast<const T*>(src), src_cols, src_col, rows, width, repeat);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_sum(const Stream& stream, const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                int64_t width, int64_t repeat) {
  const int64_t rows = dst.numel() / dst.size(-1);
  sum_repeated_columns_kernel<T><<<blocks_for(rows * width), kThreads, 0, native(stream)>>>(
      static_cast<T*>(dst.raw_data()), dst.size(-1), dst_col, static_cast<const T*>(src.raw_data()), src.size(-1),
      src_col, rows, width, repeat);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void copy_columns(const Stream& stream, const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                  int64_t width, int64_t repeat) {
  const int64_t rows = dst.numel() / dst.size(-1), bytes = static_cast<int64_t>(dtype_size(dst.dtype()));
  // In 16-byte chunks when both rows, both column offsets and the width are whole chunks and both bases aligned
  // (latent attention's blocks of 64, 128 and 512 bf16 columns): an eighth of the threads and index arithmetic.
  const auto whole_chunks = [&](int64_t elements) { return elements * bytes % 16 == 0; };
  if (whole_chunks(width) && whole_chunks(dst_col) && whole_chunks(src_col) && whole_chunks(dst.size(-1)) &&
      whole_chunks(src.size(-1)) && reinterpret_cast<uintptr_t>(dst.raw_data()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src.raw_data()) % 16 == 0) {
    const int64_t per_chunk = 16 / bytes;
    launch_copy<uint4>(stream, dst.raw_data(), dst.size(-1) / per_chunk, dst_col / per_chunk, src.raw_data(),
                       src.size(-1) / per_chunk, src_col / per_chunk, rows, width / per_chunk, repeat);
    return;
  }
  const auto launch = [&]<typename T>() {
    launch_copy<T>(stream, dst.raw_data(), dst.size(-1), dst_col, src.raw_data(), src.size(-1), src_col, rows, width,
                   repeat);
  };
  switch (bytes) {
    case 1: launch.template operator()<uint8_t>(); return;
    case 2: launch.template operator()<uint16_t>(); return;
    case 4: launch.template operator()<uint32_t>(); return;
    case 8: launch.template operator()<uint64_t>(); return;
    default: break;
  }
  MT_FAIL("copy_columns (CUDA): elements of {} bytes are not supported", bytes);
}

void sum_repeated_columns(const Stream& stream, const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                          int64_t width, int64_t repeat) {
  if (dst.dtype() == DType::BF16) {
    launch_sum<__nv_bfloat16>(stream, dst, dst_col, src, src_col, width, repeat);
    return;
  }
  launch_sum<float>(stream, dst, dst_col, src, src_col, width, repeat);
}

}  // namespace moetrain::ops::cuda
