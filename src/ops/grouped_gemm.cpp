// defines: the public grouped GEMM ops: validation of the group offsets, shapes, dtypes and devices, and dispatch
// to the CPU reference.
#include "ops/grouped_gemm.h"

#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/grouped_gemm.h"

namespace moetrain::ops {

namespace {

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

// w must be [G, N, K] in f32 or f64; the caller then reads G, N and K from it.
void check_weight_rank(const Tensor& w, const char* op, const char* name) {
  expect_defined(w, fmt::format("{}: {}", op, name));
  MT_CHECK(w.dim() == 3, "{}: expected {} [G, N, K] but found {}", op, name, w.describe());
  MT_CHECK(w.dtype() == DType::F32 || w.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           w.describe());
}

void check_matrix_rank(const Tensor& t, const char* op, const char* name, const char* dims) {
  expect_defined(t, fmt::format("{}: {}", op, name));
  MT_CHECK(t.dim() == 2, "{}: expected {} {} but found {}", op, name, dims, t.describe());
}

// offsets: i32 [G + 1] on the CPU, 0 at the start, non-decreasing, R at the end.
void check_offsets(const Tensor& offsets, int64_t groups, int64_t rows, const char* op) {
  check_argument(offsets, {groups + 1}, DType::I32, op, "offsets");
  const int32_t* off = offsets.data<int32_t>();
  MT_CHECK(off[0] == 0, "{}: offsets[0] must be 0 but found {}", op, off[0]);
  for (int64_t g = 1; g <= groups; ++g) {
    MT_CHECK(off[g] >= off[g - 1], "{}: offsets must not decrease but offsets[{}] = {} follows offsets[{}] = {}", op, g,
             off[g], g - 1, off[g - 1]);
  }
  MT_CHECK(off[groups] == rows, "{}: the last offset offsets[{}] must equal the row count R = {} but found {}", op,
           groups, rows, off[groups]);
}

}  // namespace

void grouped_linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  (void)stream;
  constexpr const char* op = "grouped_linear_forward";
  check_weight_rank(w, op, "w");
  check_matrix_rank(x, op, "x", "[R, K]");
  const int64_t groups = w.size(0), n_out = w.size(1), n_in = w.size(2), rows = x.size(0);
  const DType dtype = w.dtype();
  check_argument(w, {groups, n_out, n_in}, dtype, op, "w");
  check_argument(x, {rows, n_in}, dtype, op, "x");
  check_argument(y, {rows, n_out}, dtype, op, "y");
  check_offsets(offsets, groups, rows, op);
  cpu::grouped_linear_forward(y, x, w, offsets);
}

void grouped_linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets) {
  (void)stream;
  constexpr const char* op = "grouped_linear_backward_input";
  check_weight_rank(w, op, "w");
  check_matrix_rank(dy, op, "dy", "[R, N]");
  const int64_t groups = w.size(0), n_out = w.size(1), n_in = w.size(2), rows = dy.size(0);
  const DType dtype = w.dtype();
  check_argument(w, {groups, n_out, n_in}, dtype, op, "w");
  check_argument(dy, {rows, n_out}, dtype, op, "dy");
  check_argument(dx, {rows, n_in}, dtype, op, "dx");
  check_offsets(offsets, groups, rows, op);
  cpu::grouped_linear_backward_input(dx, dy, w, offsets);
}

void grouped_linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x,
                                    const Tensor& offsets) {
  (void)stream;
  constexpr const char* op = "grouped_linear_backward_weight";
  check_weight_rank(dw, op, "dw");
  check_matrix_rank(x, op, "x", "[R, K]");
  const int64_t groups = dw.size(0), n_out = dw.size(1), n_in = dw.size(2), rows = x.size(0);
  const DType dtype = dw.dtype();
  check_argument(dw, {groups, n_out, n_in}, dtype, op, "dw");
  check_argument(dy, {rows, n_out}, dtype, op, "dy");
  check_argument(x, {rows, n_in}, dtype, op, "x");
  check_offsets(offsets, groups, rows, op);
  cpu::grouped_linear_backward_weight(dw, dy, x, offsets);
}

}  // namespace moetrain::ops
