// defines: the public RMSNorm ops: argument validation (float dtypes, shapes of x viewed as [N, D], contiguity,
// devices) and dispatch to the CPU reference.
#include "ops/norm.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/norm.h"

namespace moetrain::ops {

namespace {

struct RowsView {
  int64_t rows = 0;
  int64_t dim = 0;
};

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

// x fixes the dtype and the [N, D] view: N = numel / D, D = x.size(-1) > 0.
RowsView check_x(const Tensor& x, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(x, what);
  require_cpu(x, op);
  MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           x.describe());
  MT_CHECK(x.dim() >= 1 && x.size(-1) > 0, "{}: expected {} with a non-empty last dimension D but found {}", op, name,
           x.describe());
  return {x.numel() / x.size(-1), x.size(-1)};
}

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

// rstd holds one value per row; any shape with N elements (e.g. [N] or x's leading dimensions) is accepted.
void check_rstd(const Tensor& rstd, const RowsView& view, DType dtype, const char* op) {
  const std::string what = fmt::format("{}: rstd", op);
  expect_dtype(rstd, dtype, what);
  expect_contiguous(rstd, what);
  require_cpu(rstd, op);
  MT_CHECK(rstd.numel() == view.rows,
           "{}: expected rstd with N = {} elements (one per row of x viewed as [{}, {}]) "
           "but found {}",
           op, view.rows, view.rows, view.dim, rstd.describe());
}

void check_params(const RmsNormParams& params, const char* op) {
  MT_CHECK(std::isfinite(params.eps) && params.eps >= 0.0f, "{}: expected eps >= 0 but found {}", op, params.eps);
}

}  // namespace

void rmsnorm_forward(Stream& stream, Tensor y, Tensor rstd, const Tensor& x, const Tensor& w,
                     const RmsNormParams& params) {
  constexpr const char* op = "rmsnorm_forward";
  check_stream(stream, op);
  const RowsView view = check_x(x, op, "x");
  check_argument(w, {view.dim}, x.dtype(), op, "w");
  check_argument(y, x.shape(), x.dtype(), op, "y");
  check_rstd(rstd, view, x.dtype(), op);
  check_params(params, op);
  cpu::rmsnorm_forward(y, rstd, x, w, params);
}

void rmsnorm_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const RmsNormParams& params) {
  constexpr const char* op = "rmsnorm_backward_input";
  check_stream(stream, op);
  const RowsView view = check_x(x, op, "x");
  check_argument(w, {view.dim}, x.dtype(), op, "w");
  check_argument(dy, x.shape(), x.dtype(), op, "dy");
  check_argument(dx, x.shape(), x.dtype(), op, "dx");
  check_rstd(rstd, view, x.dtype(), op);
  check_params(params, op);
  cpu::rmsnorm_backward_input(dx, dy, x, w, rstd, params);
}

void rmsnorm_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& rstd) {
  constexpr const char* op = "rmsnorm_backward_weight";
  check_stream(stream, op);
  const RowsView view = check_x(x, op, "x");
  check_argument(dw, {view.dim}, x.dtype(), op, "dw");
  check_argument(dy, x.shape(), x.dtype(), op, "dy");
  check_rstd(rstd, view, x.dtype(), op);
  cpu::rmsnorm_backward_weight(dw, dy, x, rstd);
}

}  // namespace moetrain::ops
