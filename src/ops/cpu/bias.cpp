// defines: the CPU bias kernels. The gradient keeps one accumulator per column of a block of kColumns columns and
// walks the rows in ascending order, so each column's sum is the plain left-to-right sum whatever the thread count.
#include "ops/cpu/bias.h"

#include <algorithm>
#include <cstdint>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

constexpr int64_t kColumns = 64;  // the columns one thread sums at a time (one cache line of f64 per row and more)

// y[r, :] += bias for r in [begin, end); the bias is widened to y's type first.
template <typename T, typename B>
void add_rows(T* y, const B* bias, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    T* row = y + r * width;
    for (int64_t n = 0; n < width; ++n) row[n] += static_cast<T>(bias[n]);
  }
}

// dbias[c] += sum over rows [begin, end), ascending, of dy[r, c], for c in [c0, c1). Nothing is added when the range
// is empty (adding 0 would turn a -0 into +0).
template <typename T>
void sum_columns(T* dbias, const T* dy, int64_t begin, int64_t end, int64_t width, int64_t c0, int64_t c1) {
  if (begin >= end) return;
  T acc[kColumns] = {};
  for (int64_t r = begin; r < end; ++r) {
    const T* row = dy + r * width;
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] += row[c];
  }
  for (int64_t c = c0; c < c1; ++c) dbias[c] += acc[c - c0];
}

// Calls f.template operator()<T, B>() for y's type T and the bias's type B (f32 or T).
template <typename F>
void dispatch_bias(const Tensor& y, const Tensor& bias, const char* op, F&& f) {
  dispatch_float(y.dtype(), op, [&]<typename T>() {
    if (bias.dtype() == DType::F32) {
      f.template operator()<T, float>();
    } else {
      f.template operator()<T, T>();
    }
  });
}

}  // namespace

void bias_add(const Tensor& y, const Tensor& bias) {
  const int64_t rows = y.size(0), width = y.size(1);
  dispatch_bias(y, bias, "bias_add", [&]<typename T, typename B>() {
    T* yp = y.data<T>();
    const B* bp = bias.data<B>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) add_rows(yp, bp, r, r + 1, width);
  });
}

void bias_backward(const Tensor& dbias, const Tensor& dy) {
  const int64_t rows = dy.size(0), width = dy.size(1);
  const int64_t blocks = (width + kColumns - 1) / kColumns;
  dispatch_float(dy.dtype(), "bias_backward", [&]<typename T>() {
    T* db = dbias.data<T>();
    const T* d = dy.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      sum_columns(db, d, 0, rows, width, b * kColumns, std::min(width, (b + 1) * kColumns));
    }
  });
}

void grouped_bias_add(const Tensor& y, const Tensor& bias, const Tensor& offsets) {
  const int64_t groups = bias.size(0), width = y.size(1);
  const int32_t* off = offsets.data<int32_t>();
  dispatch_bias(y, bias, "grouped_bias_add", [&]<typename T, typename B>() {
    T* yp = y.data<T>();
    const B* bp = bias.data<B>();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = off[g], end = off[g + 1];
#pragma omp parallel for schedule(static)
      for (int64_t r = begin; r < end; ++r) add_rows(yp, bp + g * width, r, r + 1, width);
    }
  });
}

void grouped_bias_backward(const Tensor& dbias, const Tensor& dy, const Tensor& offsets) {
  const int64_t groups = dbias.size(0), width = dy.size(1);
  const int64_t blocks = (width + kColumns - 1) / kColumns;
  const int32_t* off = offsets.data<int32_t>();
  dispatch_float(dy.dtype(), "grouped_bias_backward", [&]<typename T>() {
    T* db = dbias.data<T>();
    const T* d = dy.data<T>();
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        sum_columns(db + g * width, d, off[g], off[g + 1], width, b * kColumns, std::min(width, (b + 1) * kColumns));
      }
    }
  });
}

}  // namespace moetrain::ops::cpu
