// defines: the public gemm and linear ops: argument validation (2-D contiguous operands of one float dtype,
// matching inner dimensions, an output that overlaps no operand) and dispatch to the CPU reference.
#include "ops/gemm.h"

#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/gemm.h"

namespace moetrain::ops {

namespace {

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

void check_matrix(const Tensor& t, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_contiguous(t, what);
  require_cpu(t, op);
  MT_CHECK(t.dim() == 2, "{}: expected {} to be a 2-D matrix but found {}", op, name, t.describe());
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op, name,
           t.describe());
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.raw_data());
  const auto* b_begin = static_cast<const char*>(b.raw_data());
  return a.nbytes() > 0 && b.nbytes() > 0 && a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

const char* transpose_name(Transpose t) { return t == Transpose::No ? "" : "^T"; }

}  // namespace

void gemm(Stream& stream, Tensor out, const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
          double alpha, double beta) {
  constexpr const char* op = "gemm";
  check_stream(stream, op);
  check_matrix(out, op, "out");
  check_matrix(a, op, "a");
  check_matrix(b, op, "b");
  expect_dtype(a, out.dtype(), "gemm: a");
  expect_dtype(b, out.dtype(), "gemm: b");
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
  MT_CHECK(!overlaps(out, a) && !overlaps(out, b), "gemm: out {} must not share memory with a {} or b {}",
           out.describe(), a.describe(), b.describe());
  cpu::gemm(out, a, transpose_a, b, transpose_b, alpha, beta);
}

void linear_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& w) {
  constexpr const char* op = "linear_forward";
  check_matrix(x, op, "x [M, K]");
  check_matrix(w, op, "w [N, K]");
  check_matrix(y, op, "y [M, N]");
  expect_dtype(w, x.dtype(), "linear_forward: w");
  expect_dtype(y, x.dtype(), "linear_forward: y");
  MT_CHECK(x.size(1) == w.size(1), "linear_forward: x [M, K] is {} but w [N, K] is {}: K differs", shape_str(x.shape()),
           shape_str(w.shape()));
  expect_shape(y, {x.size(0), w.size(0)}, "linear_forward: y [M, N]");
  gemm(stream, y, x, Transpose::No, w, Transpose::Yes, 1.0, 0.0);
}

void linear_backward_input(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& w) {
  constexpr const char* op = "linear_backward_input";
  check_matrix(dy, op, "dy [M, N]");
  check_matrix(w, op, "w [N, K]");
  check_matrix(dx, op, "dx [M, K]");
  expect_dtype(w, dy.dtype(), "linear_backward_input: w");
  expect_dtype(dx, dy.dtype(), "linear_backward_input: dx");
  MT_CHECK(dy.size(1) == w.size(0), "linear_backward_input: dy [M, N] is {} but w [N, K] is {}: N differs",
           shape_str(dy.shape()), shape_str(w.shape()));
  expect_shape(dx, {dy.size(0), w.size(1)}, "linear_backward_input: dx [M, K]");
  gemm(stream, dx, dy, Transpose::No, w, Transpose::No, 1.0, 0.0);
}

void linear_backward_weight(Stream& stream, Tensor dw, const Tensor& dy, const Tensor& x) {
  constexpr const char* op = "linear_backward_weight";
  check_matrix(dy, op, "dy [M, N]");
  check_matrix(x, op, "x [M, K]");
  check_matrix(dw, op, "dw [N, K]");
  expect_dtype(x, dy.dtype(), "linear_backward_weight: x");
  expect_dtype(dw, dy.dtype(), "linear_backward_weight: dw");
  MT_CHECK(dy.size(0) == x.size(0), "linear_backward_weight: dy [M, N] is {} but x [M, K] is {}: M differs",
           shape_str(dy.shape()), shape_str(x.shape()));
  expect_shape(dw, {dy.size(1), x.size(1)}, "linear_backward_weight: dw [N, K]");
  gemm(stream, dw, dy, Transpose::Yes, x, Transpose::No, 1.0, 1.0);
}

}  // namespace moetrain::ops
