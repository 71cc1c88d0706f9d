// defines: the column-block moves' argument checks and their dispatch to the CPU reference or the CUDA kernels.
#include "ops/columns.h"

#include <string>

#include "ops/cpu/columns.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/columns.h"
#endif

namespace moetrain::ops {

namespace {

struct Shape2 {
  int64_t rows = 0, cols = 0;
};

Shape2 as_matrix(const Tensor& t, const Stream& stream, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_defined(t, what);
  expect_contiguous(t, what);
  check_on_stream_device(stream, t, op, name);
  MT_CHECK(t.dim() >= 1 && t.size(-1) > 0, "{}: expected {} with a non-empty last dimension but found {}", op, name,
           t.describe());
  return {t.numel() / t.size(-1), t.size(-1)};
}

void check_block(const Shape2& dst, int64_t dst_col, const Shape2& src, int64_t src_col, int64_t width,
                 const char* op) {
  MT_CHECK(width >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + width <= dst.cols && src_col + width <= src.cols,
           "{}: columns [{}, {}) of dst ({} columns) and [{}, {}) of src ({} columns) must lie inside them", op,
           dst_col, dst_col + width, dst.cols, src_col, src_col + width, src.cols);
}

}  // namespace

void copy_columns(Stream& stream, Tensor dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  int64_t repeat) {
  constexpr const char* op = "copy_columns";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  const Shape2 d = as_matrix(dst, stream, op, "dst"), s = as_matrix(src, stream, op, "src");
  MT_CHECK(dst.dtype() == src.dtype(), "{}: dst is {} but src is {}", op, dst.describe(), src.describe());
  MT_CHECK(repeat >= 1 && d.rows == s.rows * repeat,
           "{}: expected rows(dst) = rows(src) x repeat but found {} rows, {} rows and repeat {}", op, d.rows, s.rows,
           repeat);
  check_block(d, dst_col, s, src_col, width, op);
  if (width == 0 || d.rows == 0) return;
#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    cuda::copy_columns(stream, dst, dst_col, src, src_col, width, repeat);
    return;
  }
#endif
  cpu::copy_columns(dst, dst_col, src, src_col, width, repeat);
}

void sum_repeated_columns(Stream& stream, Tensor dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                          int64_t width, int64_t repeat) {
  constexpr const char* op = "sum_repeated_columns";
  OpScope profile(stream, "elementwise", op);
  check_stream_backend(stream, op);
  const Shape2 d = as_matrix(dst, stream, op, "dst"), s = as_matrix(src, stream, op, "src");
  MT_CHECK(dst.dtype() == src.dtype(), "{}: dst is {} but src is {}", op, dst.describe(), src.describe());
  const DType dt = dst.dtype();
  const bool float_ok = stream.device().is_cuda() ? (dt == DType::F32 || dt == DType::BF16)
                                                  : (dt == DType::F32 || dt == DType::F64 || dt == DType::BF16);
  MT_CHECK(float_ok, "{}: dtype {} is not summed on {}", op, dtype_name(dt), stream.device().str());
  MT_CHECK(repeat >= 1 && s.rows == d.rows * repeat,
           "{}: expected rows(src) = rows(dst) x repeat but found {} rows, {} rows and repeat {}", op, s.rows, d.rows,
           repeat);
  check_block(d, dst_col, s, src_col, width, op);
  if (width == 0 || d.rows == 0) return;
#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    cuda::sum_repeated_columns(stream, dst, dst_col, src, src_col, width, repeat);
    return;
  }
#endif
  cpu::sum_repeated_columns(dst, dst_col, src, src_col, width, repeat);
}

}  // namespace moetrain::ops
