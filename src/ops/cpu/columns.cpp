// defines: the CPU column-block moves: a memcpy per row for the copy, and per output row an ascending sum of its
// repeat source rows (bf16 through f32 registers).
#include "ops/cpu/columns.h"

#include <cstring>

#include "core/dtype.h"
#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

template <typename A, typename S, typename Load, typename Store>
void repeated_sums(S* dst, int64_t dst_cols, int64_t dst_col, const S* src, int64_t src_cols, int64_t src_col,
                   int64_t rows, int64_t width, int64_t repeat, Load load, Store store) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      A acc = load(src[(r * repeat) * src_cols + src_col + j]);
      for (int64_t i = 1; i < repeat; ++i) acc += load(src[(r * repeat + i) * src_cols + src_col + j]);
      dst[r * dst_cols + dst_col + j] = store(acc);
    }
  }
}

}  // namespace

void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  int64_t repeat) {
  const size_t esize = dtype_size(dst.dtype());
  const int64_t dst_cols = dst.size(-1), src_cols = src.size(-1);
  const int64_t rows = dst.numel() / dst_cols;
  auto* d = static_cast<unsigned char*>(dst.raw_data());
  const auto* s = static_cast<const unsigned char*>(src.raw_data());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(d + (static_cast<size_t>(r * dst_cols + dst_col)) * esize,
                s + (static_cast<size_t>((r / repeat) * src_cols + src_col)) * esize,
                static_cast<size_t>(width) * esize);
  }
}

void sum_repeated_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                          int64_t repeat) {
  const int64_t dst_cols = dst.size(-1), src_cols = src.size(-1);
  const int64_t rows = dst.numel() / dst_cols;
  if (dst.dtype() == DType::BF16) {
    repeated_sums<float>(
        static_cast<uint16_t*>(dst.raw_data()), dst_cols, dst_col, static_cast<const uint16_t*>(src.raw_data()),
        src_cols, src_col, rows, width, repeat, [](uint16_t bits) { return bf16_bits_to_f32(bits); },
        [](float v) { return f32_to_bf16_bits(v); });
    return;
  }
  dispatch_float(dst.dtype(), "sum_repeated_columns", [&]<typename T>() {
    repeated_sums<T>(
        dst.data<T>(), dst_cols, dst_col, src.data<T>(), src_cols, src_col, rows, width, repeat, [](T v) { return v; },
        [](T v) { return v; });
  });
}

}  // namespace moetrain::ops::cpu
