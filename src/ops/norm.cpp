// defines: the public RMSNorm ops: argument validation (float dtypes, shapes of x viewed as [N, D], contiguity,
// devices) and dispatch to the backend of the stream's device: the CPU reference, or the CUDA kernels.
#include "ops/norm.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/elementwise.h"
#include "ops/cpu/norm.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/norm.h"
#endif

namespace moetrain::ops {

namespace {

struct RowsView {
  int64_t rows = 0;
  int64_t dim = 0;
};

// The dtypes of each backend. CPU: one float dtype (f32 or f64, x's) for everything. CUDA: x, y, dy, dx (and the
// fused add's a, b, sum) each in f32 or bf16, independently: an f32 residual stream feeds bf16 activations (y) and
// takes their gradients (dy) under bf16 compute; w, dw and rstd in f32.
struct NormDTypes {
  DType activation;
  DType weight;
  DType rstd;
};

// x fixes the dtypes and the [N, D] view: N = numel / D, D = x.size(-1) > 0.
RowsView check_x(const Tensor& x, const Stream& stream, NormDTypes* dtypes, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(x, what);
  check_on_stream_device(stream, x, op, name);
  if (stream.device().is_cuda()) {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 (CUDA) but found {}",
             op, name, x.describe());
    *dtypes = {x.dtype(), DType::F32, DType::F32};
  } else {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
             x.describe());
    *dtypes = {x.dtype(), x.dtype(), x.dtype()};
  }
  MT_CHECK(x.dim() >= 1 && x.size(-1) > 0, "{}: expected {} with a non-empty last dimension D but found {}", op, name,
           x.describe());
  return {x.numel() / x.size(-1), x.size(-1)};
}

// An activation operand other than x: shaped as x; in x's dtype on the CPU, in f32 or bf16 on CUDA.
void check_activation(const Tensor& t, const Shape& shape, const NormDTypes& dtypes, const Stream& stream,
                      const char* op, const char* name) {
  const bool cuda_float = stream.device().is_cuda() && (t.dtype() == DType::F32 || t.dtype() == DType::BF16);
  check_argument(t, shape, cuda_float ? t.dtype() : dtypes.activation, stream, op, name);
}

// In-place forms (an output over an input) need one dtype: a kernel rewrites an element only after reading it, in
// its own width.
void check_alias(const Tensor& out, const Tensor& in, const char* op, const char* out_name, const char* in_name) {
  MT_CHECK(out.numel() == 0 || out.raw_data() != in.raw_data() || out.dtype() == in.dtype(),
           "{}: {} may overwrite {} only in the same dtype, but {} is {} and {} is {}", op, out_name, in_name, out_name,
           dtype_name(out.dtype()), in_name, dtype_name(in.dtype()));
}

// rstd holds one value per row; any shape with N elements (e.g. [N] or x's leading dimensions) is accepted.
void check_rstd(const Tensor& rstd, const RowsView& view, DType dtype, const Stream& stream, const char* op) {
  const std::string what = fmt::format("{}: rstd", op);
  expect_dtype(rstd, dtype, what);
  expect_contiguous(rstd, what);
  check_on_stream_device(stream, rstd, op, "rstd");
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
  OpScope profile(stream, "norm", op);
  check_rmsnorm_forward(stream, y, rstd, x, w, params, op);
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_forward(stream, y, rstd, x, w, params);
    return;
  }
#endif
  cpu::rmsnorm_forward(y, rstd, x, w, params);
}

void add_rmsnorm_forward(Stream& stream, Tensor sum, Tensor y, Tensor rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, const RmsNormParams& params) {
  constexpr const char* op = "add_rmsnorm_forward";
  OpScope profile(stream, "norm", op);
  check_stream_backend(stream, op);
  NormDTypes dtypes{};
  const RowsView view = check_x(a, stream, &dtypes, op, "a");
  check_activation(b, a.shape(), dtypes, stream, op, "b");
  check_argument(w, {view.dim}, dtypes.weight, stream, op, "w");
  check_activation(sum, a.shape(), dtypes, stream, op, "sum");
  check_activation(y, a.shape(), dtypes, stream, op, "y");
  check_alias(sum, a, op, "sum", "a");
  check_alias(sum, b, op, "sum", "b");
  check_alias(y, a, op, "y", "a");
  check_alias(y, b, op, "y", "b");
  // The residual (sum, a) and the activations (y, b) each share a dtype: the kernels are built for those pairs.
  MT_CHECK(sum.dtype() == a.dtype() && y.dtype() == b.dtype(),
           "{}: expected sum in a's dtype ({}) and y in b's ({}) but found sum {} and y {}", op, dtype_name(a.dtype()),
           dtype_name(b.dtype()), dtype_name(sum.dtype()), dtype_name(y.dtype()));
  check_rstd(rstd, view, dtypes.rstd, stream, op);
  check_params(params, op);
  MT_CHECK(sum.numel() == 0 || sum.raw_data() != y.raw_data(),
           "{}: expected y and sum in separate memory (the norm would overwrite the residual) but both are at {}", op,
           sum.raw_data());
#if MOETRAIN_HAS_CUDA
  if (a.device().is_cuda()) {
    cuda::add_rmsnorm_forward(stream, sum, y, rstd, a, b, w, params);
    return;
  }
#endif
  cpu::add_rmsnorm_forward(sum, y, rstd, a, b, w, params);
}

void check_rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                           const RmsNormParams& params, const char* op) {
  check_stream_backend(stream, op);
  NormDTypes dtypes{};
  const RowsView view = check_x(x, stream, &dtypes, op, "x");
  check_argument(w, {view.dim}, dtypes.weight, stream, op, "w");
  check_activation(y, x.shape(), dtypes, stream, op, "y");
  check_rstd(rstd, view, dtypes.rstd, stream, op);
  check_params(params, op);
}

void check_rmsnorm_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x,
                                  const Tensor& w, const Tensor& rstd, const RmsNormParams& params, const char* op) {
  check_stream_backend(stream, op);
  NormDTypes dtypes{};
  const RowsView view = check_x(x, stream, &dtypes, op, "x");
  check_argument(w, {view.dim}, dtypes.weight, stream, op, "w");
  check_activation(dy, x.shape(), dtypes, stream, op, "dy");
  check_activation(dx, x.shape(), dtypes, stream, op, "dx");
  check_alias(dx, dy, op, "dx", "dy");
  // The gradient of x in x's dtype (the stream's gradient in the stream's dtype): the kernels are built for that.
  MT_CHECK(dx.dtype() == x.dtype(), "{}: expected dx in x's dtype ({}) but found {}", op, dtype_name(x.dtype()),
           dtype_name(dx.dtype()));
  check_rstd(rstd, view, dtypes.rstd, stream, op);
  check_params(params, op);
}

void rmsnorm_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const RmsNormParams& params) {
  constexpr const char* op = "rmsnorm_backward_input";
  OpScope profile(stream, "norm", op);
  check_rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params, op);
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params);
    return;
  }
#endif
  cpu::rmsnorm_backward_input(dx, dy, x, w, rstd, params);
}

void rmsnorm_backward_input_add(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& x, const Tensor& w,
                                const Tensor& rstd, const RmsNormParams& params, const Tensor& addend) {
  constexpr const char* op = "rmsnorm_backward_input_add";
  OpScope profile(stream, "norm", op);
  check_rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params, op);
  check_argument(addend, x.shape(), dx.dtype(), stream, op, "addend");
  MT_CHECK(!share_memory(addend, dx), "{}: expected the addend {} apart from dx {} (dx is written before it is added)",
           op, addend.describe(), dx.describe());
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params, addend);
    return;
  }
#endif
  cpu::rmsnorm_backward_input(dx, dy, x, w, rstd, params);
  cpu::accumulate(dx, addend);
}

void rmsnorm_backward(Stream& stream, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, const RmsNormParams& params, const Tensor& addend) {
  constexpr const char* op = "rmsnorm_backward";
  OpScope profile(stream, "norm", op);
  check_rmsnorm_backward_input(stream, dx, dy, x, w, rstd, params, op);
  check_argument(dw, {w.numel()}, w.dtype(), stream, op, "dw");
  if (addend.defined()) {
    check_argument(addend, x.shape(), dx.dtype(), stream, op, "addend");
    MT_CHECK(!share_memory(addend, dx),
             "{}: expected the addend {} apart from dx {} (dx is written before it is added)", op, addend.describe(),
             dx.describe());
  }
  MT_CHECK(!share_memory(dw, dx) && !share_memory(dw, dy),
           "{}: expected dw {} apart from dx {} and dy {} (it is summed while they are read and written)", op,
           dw.describe(), dx.describe(), dy.describe());
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_backward_input_weight(stream, dx, dw, dy, x, w, rstd, params, addend);
    return;
  }
#endif
  // The weight gradient first: dx may overwrite dy.
  cpu::rmsnorm_backward_weight(dw, dy, x, rstd);
  cpu::rmsnorm_backward_input(dx, dy, x, w, rstd, params);
  if (addend.defined()) cpu::accumulate(dx, addend);
}

void rmsnorm_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& rstd) {
  constexpr const char* op = "rmsnorm_backward_weight";
  OpScope profile(stream, "norm", op);
  check_stream_backend(stream, op);
  NormDTypes dtypes{};
  const RowsView view = check_x(x, stream, &dtypes, op, "x");
  check_argument(dw, {view.dim}, dtypes.weight, stream, op, "dw");
  check_activation(dy, x.shape(), dtypes, stream, op, "dy");
  check_rstd(rstd, view, dtypes.rstd, stream, op);
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rmsnorm_backward_weight(stream, dw, dy, x, rstd);
    return;
  }
#endif
  cpu::rmsnorm_backward_weight(dw, dy, x, rstd);
}

}  // namespace moetrain::ops
