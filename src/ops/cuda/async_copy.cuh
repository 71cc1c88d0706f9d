// defines: asynchronous global -> shared copies (Ampere's cp.async, on Hopper too) for kernels that stage the next
// tile while they compute on the current one: the raw 4- and 16-byte copies, commit / wait, and a row-block copy
// that takes the widest copy the addresses allow (16 bytes, 4 bytes, else plain loads and stores).
#pragma once

#include <cstdint>
#include <type_traits>

namespace moetrain::ops::cuda {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global));
}

__device__ __forceinline__ void copy_async_4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(shared)), "l"(global));
}

// Closes the group of copies issued so far by this thread; wait_copies<N> returns once at most N of this thread's
// groups are still in flight. A barrier after the wait makes every thread's copies visible to the block.
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows, c < cols, by the whole block (blockDim.x threads).
// Asynchronous when the row starts and lengths allow 16- or 4-byte copies (then it joins the thread's open group);
// otherwise plain loads and stores, complete before the next barrier.
template <typename E>
__device__ void copy_rows_async(E* dst, int64_t dst_stride, const E* src, int64_t src_stride, int rows, int cols) {
  const auto aligned = [&](int64_t bytes) {
    return (cols * int64_t(sizeof(E))) % bytes == 0 && (src_stride * int64_t(sizeof(E))) % bytes == 0 &&
           (dst_stride * int64_t(sizeof(E))) % bytes == 0 && reinterpret_cast<uintptr_t>(src) % bytes == 0 &&
           reinterpret_cast<uintptr_t>(dst) % bytes == 0;
  };
  const auto copy_in_pieces = [&](auto piece_bytes, auto copy) {
    constexpr int kBytes = decltype(piece_bytes)::value;
    const int per_row = static_cast<int>(cols * int64_t(sizeof(E)) / kBytes);
    for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
      const int r = e / per_row, p = e % per_row;
      copy(reinterpret_cast<char*>(dst + r * dst_stride) + kBytes * p,
           reinterpret_cast<const char*>(src + r * src_stride) + kBytes * p);
    }
  };
  if (aligned(16)) {
    copy_in_pieces(std::integral_constant<int, 16>{}, [](void* s, const void* g) { copy_async_16(s, g); });
  } else if (aligned(4)) {
    copy_in_pieces(std::integral_constant<int, 4>{}, [](void* s, const void* g) { copy_async_4(s, g); });
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
      dst[(e / cols) * dst_stride + e % cols] = src[(e / cols) * src_stride + e % cols];
    }
  }
}

}  // namespace moetrain::ops::cuda
