// defines: the CPU gemm kernel. Work is cut in tasks of (a chunk of output rows) x (a panel of output columns);
// a task packs its rows of op(a) and its columns of op(b) k-major, then a register tile of kMR x kNR accumulators
// walks k in ascending order: acc[r][c] += a[r][k] * b[k][c], vectorised across c (never across k), so every
// element is the same sequence of roundings as a plain ascending dot product whatever the tile or task it falls in.
#include "ops/cpu/gemm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/dispatch.h"

namespace moetrain::ops::cpu {

namespace {

constexpr int64_t kMR = 4;                           // rows of the register tile
constexpr int64_t kRowChunk = 64;                    // rows of op(a) per task, a multiple of kMR
constexpr int64_t kColPanel = 64;                    // columns of op(b) per task, a multiple of kNR
constexpr int64_t kParallelWork = int64_t{1} << 15;  // multiply-adds below which one thread does it all

template <typename T>
constexpr int64_t kNR = 32 / sizeof(T);  // columns of the register tile: 8 floats, 4 doubles

// Element (i, k) of op(a) is a[i * row_stride + k * k_stride]; element (k, j) of op(b) is b[k * k_stride +
// j * col_stride].
template <typename T>
struct Operand {
  const T* data = nullptr;
  int64_t outer_stride = 0;  // i for op(a), j for op(b)
  int64_t k_stride = 0;
};

// Packs rows [i0, i0 + rows) of op(a) as tiles of kMR rows, each tile [K][kMR]; rows past the end are zero.
template <typename T>
void pack_rows(T* dst, const Operand<T>& a, int64_t i0, int64_t rows, int64_t K) {
  const int64_t tiles = (rows + kMR - 1) / kMR;
  for (int64_t t = 0; t < tiles; ++t) {
    T* tile = dst + t * K * kMR;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r < kMR; ++r) {
        const int64_t i = t * kMR + r;
        tile[k * kMR + r] = i < rows ? a.data[(i0 + i) * a.outer_stride + k * a.k_stride] : T(0);
      }
    }
  }
}

// Packs columns [j0, j0 + cols) of op(b) as strips of kNR columns, each strip [K][kNR]; columns past the end are
// zero.
template <typename T>
void pack_cols(T* dst, const Operand<T>& b, int64_t j0, int64_t cols, int64_t K) {
  constexpr int64_t nr = kNR<T>;
  const int64_t strips = (cols + nr - 1) / nr;
  for (int64_t s = 0; s < strips; ++s) {
    T* strip = dst + s * K * nr;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t c = 0; c < nr; ++c) {
        const int64_t j = s * nr + c;
        strip[k * nr + c] = j < cols ? b.data[k * b.k_stride + (j0 + j) * b.outer_stride] : T(0);
      }
    }
  }
}

// One register tile: out[i][j] for the valid rows x cols of the tile (out points at its top-left element).
template <typename T>
void tile_kernel(T* out, int64_t ldo, int64_t rows, int64_t cols, const T* a_tile, const T* b_strip, int64_t K, T alpha,
                 T beta) {
  constexpr int64_t nr = kNR<T>;
  T acc[kMR][nr] = {};
  for (int64_t k = 0; k < K; ++k) {
    const T* ak = a_tile + k * kMR;
    const T* bk = b_strip + k * nr;
    for (int64_t r = 0; r < kMR; ++r) {
      for (int64_t c = 0; c < nr; ++c) acc[r][c] += ak[r] * bk[c];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + r * ldo;
    if (beta == T(0)) {
      for (int64_t c = 0; c < cols; ++c) o[c] = alpha * acc[r][c];
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = alpha * acc[r][c] + beta * o[c];
    }
  }
}

template <typename T>
void gemm_typed(T* out, const Operand<T>& a, const Operand<T>& b, int64_t M, int64_t N, int64_t K, T alpha, T beta) {
  constexpr int64_t nr = kNR<T>;
  const int64_t row_chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t col_panels = (N + kColPanel - 1) / kColPanel;
  const bool parallel = M * N * K >= kParallelWork && row_chunks * col_panels > 1;
#pragma omp parallel if (parallel)
  {
    std::vector<T> a_pack(static_cast<size_t>(kRowChunk * K));
    std::vector<T> b_pack(static_cast<size_t>(kColPanel * K));
#pragma omp for collapse(2) schedule(static)
    for (int64_t rc = 0; rc < row_chunks; ++rc) {
      for (int64_t cp = 0; cp < col_panels; ++cp) {
        const int64_t i0 = rc * kRowChunk;
        const int64_t rows = std::min(kRowChunk, M - i0);
        const int64_t j0 = cp * kColPanel;
        const int64_t cols = std::min(kColPanel, N - j0);
        pack_rows(a_pack.data(), a, i0, rows, K);
        pack_cols(b_pack.data(), b, j0, cols, K);
        for (int64_t r = 0; r < rows; r += kMR) {
          for (int64_t c = 0; c < cols; c += nr) {
            tile_kernel(out + (i0 + r) * N + (j0 + c), N, std::min(kMR, rows - r), std::min(nr, cols - c),
                        a_pack.data() + r * K, b_pack.data() + c * K, K, alpha, beta);
          }
        }
      }
    }
  }
}

}  // namespace

void gemm(const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
          double alpha, double beta) {
  const int64_t M = out.size(0);
  const int64_t N = out.size(1);
  const int64_t K = transpose_a == Transpose::No ? a.size(1) : a.size(0);
  dispatch_float(out.dtype(), "gemm", [&]<typename T>() {
    // op(a) = a [M, K] or a^T with a [K, M]; op(b) = b [K, N] or b^T with b [N, K].
    const Operand<T> a_op =
        transpose_a == Transpose::No ? Operand<T>{a.data<T>(), K, 1} : Operand<T>{a.data<T>(), 1, M};
    const Operand<T> b_op =
        transpose_b == Transpose::No ? Operand<T>{b.data<T>(), 1, N} : Operand<T>{b.data<T>(), K, 1};
    gemm_typed<T>(out.data<T>(), a_op, b_op, M, N, K, static_cast<T>(alpha), static_cast<T>(beta));
  });
}

}  // namespace moetrain::ops::cpu
