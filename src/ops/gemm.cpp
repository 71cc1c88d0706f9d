// defines: the public gemm and linear ops: argument validation (2-D contiguous operands, matching inner dimensions,
// an output that overlaps no operand, tensors and stream on one device) and dispatch to the backend: the CPU
// reference (one float dtype, f32 or f64) or, for CUDA tensors, cuBLASLt (f32, or bf16 operands with a bf16 or f32
// output).
#include "ops/gemm.h"

#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/gemm.h"
#include "ops/elementwise.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/gemm.h"
#include "ops/cuda/runtime.h"
#endif

namespace moetrain::ops {

namespace {

// A 2-D contiguous matrix in a dtype its backend computes with: f32 or f64 on the CPU, f32 or bf16 on CUDA.
void check_matrix(const Stream& stream, const Tensor& t, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_defined(t, what);
  expect_contiguous(t, what);
  check_tensor_backend(stream, t, op, name);
  MT_CHECK(t.dim() == 2, "{}: expected {} to be a 2-D matrix but found {}", op, name, t.describe());
  if (on_cuda(t)) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 on CUDA but found {}",
             op, name, t.describe());
  } else {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
             t.describe());
  }
}

// The output's dtype given the operands' (already equal) dtype: the same on the CPU; on CUDA the same, or f32 for
// bf16 operands (f32 accumulation written out unrounded, e.g. a weight gradient).
void check_output_dtype(const Tensor& out, DType operand, const char* op, const char* name) {
  if (on_cuda(out) && operand == DType::BF16) {
    MT_CHECK(out.dtype() == DType::BF16 || out.dtype() == DType::F32,
             "{}: {}: expected dtype bf16 or f32 for bf16 operands but found {}", op, name, dtype_name(out.dtype()));
    return;
  }
  expect_dtype(out, operand, fmt::format("{}: {}", op, name));
}

const char* transpose_name(Transpose t) { return t == Transpose::No ? "" : "^T"; }

// The arguments of the input-gradient ops: dx [M, K] = dy [M, N] * w [N, K].
void check_linear_backward_input(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w,
                                 const char* op) {
  check_matrix(stream, dy, op, "dy [M, N]");
  check_matrix(stream, w, op, "w [N, K]");
  check_matrix(stream, dx, op, "dx [M, K]");
  expect_dtype(w, dy.dtype(), fmt::format("{}: w", op));
  check_output_dtype(dx, dy.dtype(), op, "dx");
  MT_CHECK(dy.size(1) == w.size(0), "{}: dy [M, N] is {} but w [N, K] is {}: N differs", op, shape_str(dy.shape()),
           shape_str(w.shape()));
  expect_shape(dx, {dy.size(0), w.size(1)}, fmt::format("{}: dx [M, K]", op));
}

}  // namespace

void gemm(Stream& stream, Tensor out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
          double alpha, double beta) {
  constexpr const char* op = "gemm";
  OpScope profile(stream, "gemm", op);
  check_matrix(stream, out, op, "out");
  check_matrix(stream, a, op, "a");
  check_matrix(stream, b, op, "b");
  if (on_cuda(out)) {
    expect_dtype(b, a.dtype(), "gemm: b");
    check_output_dtype(out, a.dtype(), op, "out");
  } else {
    expect_dtype(a, out.dtype(), "gemm: a");
    expect_dtype(b, out.dtype(), "gemm: b");
  }
  const bool ta = transpose_a == Transpose::Yes;
  const bool tb = transpose_b == Transpose::Yes;
  const int64_t m = ta ? a.size(1) : a.size(0);
  const int64_t k_a = ta ? a.size(0) : a.size(1);
  const int64_t k_b = tb ? b.size(1) : b.size(0);
  const int64_t n = tb ? b.size(0) : b.size(1);
  MT_CHECK(k_a == k_b,
           "gemm: inner dimensions differ: op(a) = a{} is [{}, {}] (a {}) but op(b) = b{} is [{}, {}] (b {})",
           transpose_name(transpose_a), m, k_a, shape_str(a.shape()), transpose_name(transpose_b), k_b, n,
           shape_str(b.shape()));
  expect_shape(out, {m, n}, fmt::format("gemm: out (= op(a) [{}, {}] * op(b) [{}, {}])", m, k_a, k_b, n));
  MT_CHECK(!share_memory(out, a) && !share_memory(out, b), "gemm: out {} must not share memory with a {} or b {}",
           out.describe(), a.describe(), b.describe());
#if MOETRAIN_HAS_CUDA
  if (on_cuda(out)) {
    cuda::gemm(stream, out, a, transpose_a, b, transpose_b, alpha, beta);
    return;
  }
#endif
  cpu::gemm(out, a, transpose_a, b, transpose_b, alpha, beta);
}

void linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w) {
  constexpr const char* op = "linear_forward";
  OpScope profile(stream, "gemm", op);
  check_matrix(stream, x, op, "x [M, K]");
  check_matrix(stream, w, op, "w [N, K]");
  check_matrix(stream, y, op, "y [M, N]");
  expect_dtype(w, x.dtype(), "linear_forward: w");
  check_output_dtype(y, x.dtype(), op, "y");
  MT_CHECK(x.size(1) == w.size(1), "linear_forward: x [M, K] is {} but w [N, K] is {}: K differs", shape_str(x.shape()),
           shape_str(w.shape()));
  expect_shape(y, {x.size(0), w.size(0)}, "linear_forward: y [M, N]");
  gemm(stream, y, x, Transpose::No, w, Transpose::Yes, 1.0, 0.0);
}

void linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w) {
  constexpr const char* op = "linear_backward_input";
  OpScope profile(stream, "gemm", op);
  check_linear_backward_input(stream, dx, dy, w, op);
  gemm(stream, dx, dy, Transpose::No, w, Transpose::No, 1.0, 0.0);
}

void linear_backward_input_accumulate(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w) {
  constexpr const char* op = "linear_backward_input_accumulate";
  OpScope profile(stream, "gemm", op);
  check_linear_backward_input(stream, dx, dy, w, op);
  if (on_cuda(dx) && batch_invariant(stream) && dx.dtype() == DType::BF16) {
    Tensor product = Tensor::empty(dx.shape(), dx.dtype(), dx.device());
    gemm(stream, product, dy, Transpose::No, w, Transpose::No, 1.0, 0.0);
    accumulate(stream, dx, product);
    return;
  }
  gemm(stream, dx, dy, Transpose::No, w, Transpose::No, 1.0, 1.0);
}

void linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x, GradientWrite write) {
  constexpr const char* op = "linear_backward_weight";
  OpScope profile(stream, "gemm", op);
  check_matrix(stream, dy, op, "dy [M, N]");
  check_matrix(stream, x, op, "x [M, K]");
  check_matrix(stream, dw, op, "dw [N, K]");
  expect_dtype(x, dy.dtype(), "linear_backward_weight: x");
  check_output_dtype(dw, dy.dtype(), op, "dw");
  MT_CHECK(dy.size(0) == x.size(0), "linear_backward_weight: dy [M, N] is {} but x [M, K] is {}: M differs",
           shape_str(dy.shape()), shape_str(x.shape()));
  expect_shape(dw, {dy.size(1), x.size(1)}, "linear_backward_weight: dw [N, K]");
  // The CPU's beta = 0 form would skip the addition of 0 that turns a -0 product sum into +0 (its sums start from
  // the first product); zeros first keep the accumulating bytes. An empty sum has no GEMM to overwrite with.
  const bool overwrite = write == GradientWrite::Overwrite;
  if (overwrite && (!on_cuda(dw) || dy.size(0) == 0)) {
    zero_on_stream(stream, dw);
    gemm(stream, dw, dy, Transpose::Yes, x, Transpose::No, 1.0, 1.0);
    return;
  }
  gemm(stream, dw, dy, Transpose::Yes, x, Transpose::No, 1.0, overwrite ? 0.0 : 1.0);
}

}  // namespace moetrain::ops
