// defines: the CPU grouped GEMM reference. Parallel over independent output elements only; every reduction runs
// in one thread in ascending order, so a row's result does not depend on the other rows of its group or batch.
// Register tiles of kTile x kTile outputs keep several independent reductions in flight per thread.
#include "ops/cpu/grouped_gemm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

constexpr int64_t kTile = 4;

// A run of up to kTile consecutive rows [begin, begin + count) of one group.
struct RowTile {
  int64_t group;
  int64_t begin;
  int64_t count;
};

std::vector<RowTile> row_tiles(const Tensor& offsets) {
  const int32_t* off = offsets.data<int32_t>();
  const int64_t groups = offsets.numel() - 1;
  std::vector<RowTile> tiles;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = off[g]; r < off[g + 1]; r += kTile)
      tiles.push_back({g, r, std::min<int64_t>(kTile, off[g + 1] - r)});
  }
  return tiles;
}

// c[i][j] = sum_k a_i[k] * b_j[k] for k ascending, over n elements. Callers pad a partial tile by repeating a
// valid row and discard the padded results, so every element is computed by the same instructions wherever it
// lies in a tile.
template <typename T>
void dot_tile(const T* const (&a)[kTile], const T* const (&b)[kTile], int64_t n, T (&c)[kTile][kTile]) {
  T acc[kTile][kTile] = {};
  for (int64_t k = 0; k < n; ++k) {
    T av[kTile], bv[kTile];
    for (int64_t i = 0; i < kTile; ++i) av[i] = a[i][k];
    for (int64_t j = 0; j < kTile; ++j) bv[j] = b[j][k];
    for (int64_t i = 0; i < kTile; ++i) {
      for (int64_t j = 0; j < kTile; ++j) acc[i][j] += av[i] * bv[j];
    }
  }
  for (int64_t i = 0; i < kTile; ++i) {
    for (int64_t j = 0; j < kTile; ++j) c[i][j] = acc[i][j];
  }
}

template <typename T>
void forward_impl(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  const int64_t n_out = w.size(1), n_in = w.size(2);
  const T* xp = x.data<T>();
  const T* wp = w.data<T>();
  T* yp = y.data<T>();
  const std::vector<RowTile> tiles = row_tiles(offsets);
  const int64_t n_tiles = (n_out + kTile - 1) / kTile;
  const int64_t work = static_cast<int64_t>(tiles.size()) * n_tiles;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < work; ++item) {
    const RowTile& tile = tiles[static_cast<size_t>(item / n_tiles)];
    const int64_t n0 = (item % n_tiles) * kTile, n_count = std::min(kTile, n_out - n0);
    const T* wg = wp + tile.group * n_out * n_in;
    const T* a[kTile];
    const T* b[kTile];
    for (int64_t i = 0; i < kTile; ++i) a[i] = xp + (tile.begin + std::min(i, tile.count - 1)) * n_in;
    for (int64_t j = 0; j < kTile; ++j) b[j] = wg + (n0 + std::min(j, n_count - 1)) * n_in;
    T c[kTile][kTile];
    dot_tile(a, b, n_in, c);
    for (int64_t i = 0; i < tile.count; ++i) {
      for (int64_t j = 0; j < n_count; ++j) yp[(tile.begin + i) * n_out + n0 + j] = c[i][j];
    }
  }
}

template <typename T>
void backward_input_impl(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& offsets) {
  const int64_t n_out = w.size(1), n_in = w.size(2);
  const T* dyp = dy.data<T>();
  const T* wp = w.data<T>();
  T* dxp = dx.data<T>();
  const std::vector<RowTile> tiles = row_tiles(offsets);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  // dx[r][k] = sum_n dy[r][n] * w[g][n][k], n ascending: rows of w[g] are streamed contiguously into the dx rows.
#pragma omp parallel for schedule(static)
  for (int64_t ti = 0; ti < num_tiles; ++ti) {
    const RowTile& tile = tiles[static_cast<size_t>(ti)];
    const T* wg = wp + tile.group * n_out * n_in;
    T* out = dxp + tile.begin * n_in;
    std::fill(out, out + tile.count * n_in, T(0));
    for (int64_t n = 0; n < n_out; ++n) {
      const T* wn = wg + n * n_in;
      for (int64_t i = 0; i < tile.count; ++i) {
        const T a = dyp[(tile.begin + i) * n_out + n];
        T* row = out + i * n_in;
        for (int64_t k = 0; k < n_in; ++k) row[k] += a * wn[k];
      }
    }
  }
}

template <typename T>
void backward_weight_impl(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& offsets) {
  const int64_t groups = dw.size(0), n_out = dw.size(1), n_in = dw.size(2);
  const int32_t* off = offsets.data<int32_t>();
  const T* dyp = dy.data<T>();
  const T* xp = x.data<T>();
  T* dwp = dw.data<T>();
  const int64_t n_tiles = (n_out + kTile - 1) / kTile;
  const int64_t work = groups * n_tiles;
  // dw[g][n][k] += sum_r dy[r][n] * x[r][k] over the group's rows r ascending; one (group, tile of n) per item.
#pragma omp parallel
  {
    std::vector<T> acc(static_cast<size_t>(kTile * n_in));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t g = item / n_tiles, n0 = (item % n_tiles) * kTile, n_count = std::min(kTile, n_out - n0);
      if (off[g] == off[g + 1]) continue;  // an empty group adds nothing
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t r = off[g]; r < off[g + 1]; ++r) {
        const T* xr = xp + r * n_in;
        for (int64_t j = 0; j < n_count; ++j) {
          const T a = dyp[r * n_out + n0 + j];
          T* row = acc.data() + j * n_in;
          for (int64_t k = 0; k < n_in; ++k) row[k] += a * xr[k];
        }
      }
      for (int64_t j = 0; j < n_count; ++j) {
        T* dst = dwp + (g * n_out + n0 + j) * n_in;
        const T* row = acc.data() + j * n_in;
        for (int64_t k = 0; k < n_in; ++k) dst[k] += row[k];
      }
    }
  }
}

}  // namespace

void grouped_linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  dispatch_float(x.dtype(), "grouped_linear_forward", [&]<typename T>() { forward_impl<T>(y, x, w, offsets); });
}

void grouped_linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& offsets) {
  dispatch_float(dy.dtype(), "grouped_linear_backward_input",
                 [&]<typename T>() { backward_input_impl<T>(dx, dy, w, offsets); });
}

void grouped_linear_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& offsets) {
  dispatch_float(dy.dtype(), "grouped_linear_backward_weight",
                 [&]<typename T>() { backward_weight_impl<T>(dw, dy, x, offsets); });
}

}  // namespace moetrain::ops::cpu
