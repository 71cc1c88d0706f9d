// defines: the CPU RMSNorm kernels, written as HF's Qwen3RMSNorm computes in f32: variance = mean(x^2),
// xhat = x * (1 / sqrt(variance + eps)), y = xhat * w (or xhat * (1 + w) when zero-centred).
#include "ops/cpu/norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

// The scale the normalised row is multiplied by: w, or 1 + w for the zero-centred variant.
template <typename T>
T scale_of(T w, bool zero_centered) {
  return zero_centered ? T(1) + w : w;
}

// One row of the forward: rstd from the ascending sum of squares, then y = (x * rstd) * scale. Every element of y is
// written after the sum, at its own index: y may alias x.
template <typename T>
void forward_row(T* yr, T* rstd_n, const T* xr, const T* w, int64_t dim, T eps, bool zero_centered) {
  T sum_sq = 0;
  for (int64_t d = 0; d < dim; ++d) sum_sq += xr[d] * xr[d];
  const T variance = sum_sq / static_cast<T>(dim);
  const T r = T(1) / std::sqrt(variance + eps);
  *rstd_n = r;
  for (int64_t d = 0; d < dim; ++d) yr[d] = (xr[d] * r) * scale_of(w[d], zero_centered);
}

template <typename T>
void forward_rows(T* y, T* rstd, const T* x, const T* w, int64_t rows, int64_t dim, T eps, bool zero_centered) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) forward_row(y + n * dim, rstd + n, x + n * dim, w, dim, eps, zero_centered);
}

// Per row: the residual sum a + b (add_forward's element code) into sum, then forward_row on it.
template <typename T>
void add_forward_rows(T* sum, T* y, T* rstd, const T* a, const T* b, const T* w, int64_t rows, int64_t dim, T eps,
                      bool zero_centered) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    T* sr = sum + n * dim;
    const T* ar = a + n * dim;
    const T* br = b + n * dim;
    for (int64_t d = 0; d < dim; ++d) sr[d] = ar[d] + br[d];
    forward_row(y + n * dim, rstd + n, sr, w, dim, eps, zero_centered);
  }
}

template <typename T>
void backward_input_rows(T* dx, const T* dy, const T* x, const T* w, const T* rstd, int64_t rows, int64_t dim,
                         bool zero_centered) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const T* xr = x + n * dim;
    const T* dyr = dy + n * dim;
    T* dxr = dx + n * dim;
    const T r = rstd[n];
    // m = mean(scale * dy * xhat), read before any dx element is written (dx may alias dy).
    T sum = 0;
    for (int64_t d = 0; d < dim; ++d) sum += (scale_of(w[d], zero_centered) * dyr[d]) * (xr[d] * r);
    const T mean = sum / static_cast<T>(dim);
    for (int64_t d = 0; d < dim; ++d) {
      const T g = scale_of(w[d], zero_centered) * dyr[d];
      const T xhat = xr[d] * r;
      dxr[d] = r * (g - xhat * mean);
    }
  }
}

// Columns are split in blocks, one block per task; inside a block the rows are walked in ascending order so each
// dw[d] is one ascending sum whatever the block size or thread count.
template <typename T>
void backward_weight_columns(T* dw, const T* dy, const T* x, const T* rstd, int64_t rows, int64_t dim) {
  constexpr int64_t kMinBlock = 16;
  const int64_t threads = std::max<int64_t>(1, omp_get_max_threads());
  const int64_t block = std::max(kMinBlock, ((dim + threads - 1) / threads + kMinBlock - 1) / kMinBlock * kMinBlock);
  const int64_t blocks = (dim + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(dim, begin + block);
    std::vector<T> acc(static_cast<size_t>(end - begin), T(0));
    for (int64_t n = 0; n < rows; ++n) {
      const T* xr = x + n * dim;
      const T* dyr = dy + n * dim;
      const T r = rstd[n];
      for (int64_t d = begin; d < end; ++d) acc[d - begin] += dyr[d] * (xr[d] * r);
    }
    for (int64_t d = begin; d < end; ++d) dw[d] += acc[d - begin];
  }
}

}  // namespace

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  dispatch_float(x.dtype(), "rmsnorm_forward", [&]<typename T>() {
    forward_rows<T>(y.data<T>(), rstd.data<T>(), x.data<T>(), w.data<T>(), rows, dim, static_cast<T>(params.eps),
                    params.zero_centered);
  });
}

void add_rmsnorm_forward(const Tensor& sum, const Tensor& y, const Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = a.numel() / dim;
  dispatch_float(a.dtype(), "add_rmsnorm_forward", [&]<typename T>() {
    add_forward_rows<T>(sum.data<T>(), y.data<T>(), rstd.data<T>(), a.data<T>(), b.data<T>(), w.data<T>(), rows, dim,
                        static_cast<T>(params.eps), params.zero_centered);
  });
}

void rmsnorm_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                            const RmsNormParams& params) {
  const int64_t dim = w.numel();
  const int64_t rows = x.numel() / dim;
  dispatch_float(x.dtype(), "rmsnorm_backward_input", [&]<typename T>() {
    backward_input_rows<T>(dx.data<T>(), dy.data<T>(), x.data<T>(), w.data<T>(), rstd.data<T>(), rows, dim,
                           params.zero_centered);
  });
}

void rmsnorm_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& rstd) {
  const int64_t dim = dw.numel();
  const int64_t rows = x.numel() / dim;
  dispatch_float(x.dtype(), "rmsnorm_backward_weight", [&]<typename T>() {
    backward_weight_columns<T>(dw.data<T>(), dy.data<T>(), x.data<T>(), rstd.data<T>(), rows, dim);
  });
}

}  // namespace moetrain::ops::cpu
