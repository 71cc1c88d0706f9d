// defines: the public attention ops: argument validation (shapes, dtypes, devices, cu_seqlens) and dispatch to
// the CPU reference.
#include "ops/attention.h"

#include <cstdint>
#include <string>

#include "ops/cpu/attention.h"
#include "ops/cpu/dispatch.h"

namespace moetrain::ops {

namespace {

struct AttentionShape {
  int64_t tokens, nh, nkv, hd, hdv;
};

// Checks q, k, v against each other and returns their extents.
AttentionShape check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  const std::string q_what = fmt::format("{}: q", op);
  const std::string k_what = fmt::format("{}: k", op);
  const std::string v_what = fmt::format("{}: v", op);
  expect_defined(q, q_what);
  expect_defined(k, k_what);
  expect_defined(v, v_what);
  MT_CHECK(q.dim() == 3, "{}: expected q [T, nh, hd] but found {}", op, q.describe());
  MT_CHECK(k.dim() == 3, "{}: expected k [T, nkv, hd] but found {}", op, k.describe());
  MT_CHECK(v.dim() == 3, "{}: expected v [T, nkv, hdv] but found {}", op, v.describe());
  const AttentionShape s{q.size(0), q.size(1), k.size(1), q.size(2), v.size(2)};
  expect_shape(k, {s.tokens, s.nkv, s.hd}, k_what);
  expect_shape(v, {s.tokens, s.nkv, s.hdv}, v_what);
  MT_CHECK(s.nkv > 0 && s.nh % s.nkv == 0,
           "{}: the query heads (nh = {}) must be a multiple of the kv heads (nkv = {})", op, s.nh, s.nkv);
  MT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::F64, "{}: expected q in f32 or f64 but found {}", op,
           q.describe());
  return s;
}

// Shape, dtype (that of q), contiguity and device of one tensor argument.
void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

void check_params(const AttentionParams& params, const char* op) {
  MT_CHECK(params.sliding_window >= 0, "{}: sliding_window must be >= 0 (0 = unlimited) but found {}", op,
           params.sliding_window);
}

}  // namespace

void validate_cu_seqlens(const Tensor& cu_seqlens, int64_t num_tokens, const char* what) {
  expect_defined(cu_seqlens, what);
  expect_dtype(cu_seqlens, DType::I32, what);
  MT_CHECK(cu_seqlens.device().is_cpu(), "{}: expected a tensor on the CPU but found {}", what, cu_seqlens.describe());
  MT_CHECK(cu_seqlens.dim() == 1, "{}: expected a 1-D tensor but found {}", what, cu_seqlens.describe());
  expect_contiguous(cu_seqlens, what);
  const int64_t n = cu_seqlens.numel();
  MT_CHECK(n >= 2, "{}: expected at least 2 entries (one document) but found {}", what, n);
  const int32_t* cu = cu_seqlens.data<int32_t>();
  MT_CHECK(cu[0] == 0, "{}: entry [0] must be 0 but found {}", what, cu[0]);
  for (int64_t i = 1; i < n; ++i) {
    MT_CHECK(cu[i] > cu[i - 1], "{}: entries must strictly increase but entry [{}] = {} follows entry [{}] = {}", what,
             i, cu[i], i - 1, cu[i - 1]);
  }
  MT_CHECK(cu[n - 1] == num_tokens, "{}: the last entry [{}] must equal the token count {} but found {}", what, n - 1,
           num_tokens, cu[n - 1]);
}

void attention_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, const AttentionParams& params) {
  (void)stream;
  constexpr const char* op = "attention_forward";
  const AttentionShape s = check_qkv(q, k, v, op);
  const DType dtype = q.dtype();
  check_argument(q, {s.tokens, s.nh, s.hd}, dtype, op, "q");
  check_argument(k, {s.tokens, s.nkv, s.hd}, dtype, op, "k");
  check_argument(v, {s.tokens, s.nkv, s.hdv}, dtype, op, "v");
  check_argument(out, {s.tokens, s.nh, s.hdv}, dtype, op, "out");
  check_argument(lse, {s.tokens, s.nh}, dtype, op, "lse");
  validate_cu_seqlens(cu_seqlens, s.tokens, "attention_forward: cu_seqlens");
  check_params(params, op);
  cpu::attention_forward(out, lse, q, k, v, cu_seqlens, params);
}

void attention_backward(Stream& stream, Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params) {
  (void)stream;
  constexpr const char* op = "attention_backward";
  const AttentionShape s = check_qkv(q, k, v, op);
  const DType dtype = q.dtype();
  check_argument(q, {s.tokens, s.nh, s.hd}, dtype, op, "q");
  check_argument(k, {s.tokens, s.nkv, s.hd}, dtype, op, "k");
  check_argument(v, {s.tokens, s.nkv, s.hdv}, dtype, op, "v");
  check_argument(out, {s.tokens, s.nh, s.hdv}, dtype, op, "out");
  check_argument(lse, {s.tokens, s.nh}, dtype, op, "lse");
  check_argument(dout, {s.tokens, s.nh, s.hdv}, dtype, op, "dout");
  check_argument(dq, {s.tokens, s.nh, s.hd}, dtype, op, "dq");
  check_argument(dk, {s.tokens, s.nkv, s.hd}, dtype, op, "dk");
  check_argument(dv, {s.tokens, s.nkv, s.hdv}, dtype, op, "dv");
  validate_cu_seqlens(cu_seqlens, s.tokens, "attention_backward: cu_seqlens");
  check_params(params, op);
  cpu::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params);
}

}  // namespace moetrain::ops
