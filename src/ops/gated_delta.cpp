// defines: the public Gated DeltaNet ops: argument validation (dtypes per backend, shapes, contiguity, devices,
// cu_seqlens, eps and scale) and dispatch to the CPU reference or the CUDA kernels of the stream's device.
#include "ops/gated_delta.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/attention.h"
#include "ops/cpu/gated_delta.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/gated_delta.h"
#include "ops/cuda/gated_delta_chunked.h"
#endif

namespace moetrain::ops {

namespace {

// The dtypes of one call: `act` for the activations, `aux` for g, beta, rstd and the 1-D weights (CPU: both the first
// input's f32 or f64; CUDA: the first input's f32 or bf16, and f32).
struct GdnDTypes {
  DType act;
  DType aux;
};

// The first input fixes the backend's dtypes; it must be defined, contiguous and on the stream's device.
GdnDTypes check_first(const Stream& stream, const Tensor& t, const char* op, const char* name) {
  check_stream_backend(stream, op);
  const std::string what = fmt::format("{}: {}", op, name);
  expect_defined(t, what);
  expect_contiguous(t, what);
  check_on_stream_device(stream, t, op, name);
  if (stream.device().is_cuda()) {
    MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: expected {} in f32 or bf16 (CUDA) but found {}",
             op, name, t.describe());
    return {t.dtype(), DType::F32};
  }
  MT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "{}: expected {} in f32 or f64 (CPU) but found {}", op,
           name, t.describe());
  return {t.dtype(), t.dtype()};
}

// The [N, D] view of a normalised tensor: D = size(-1) > 0.
int64_t check_rows(const Tensor& x, const char* op, const char* name) {
  MT_CHECK(x.dim() >= 1 && x.size(-1) > 0, "{}: expected {} with a non-empty last dimension D but found {}", op, name,
           x.describe());
  return x.numel() / x.size(-1);
}

void check_eps(float eps, const char* op) {
  MT_CHECK(std::isfinite(eps) && eps >= 0.0f, "{}: expected eps >= 0 (finite) but found {}", op, eps);
}

// cu_seqlens for the backend: fully validated on the CPU; on CUDA its values live on the device, so only its dtype,
// shape and device are checked here (the caller validates the host copy with validate_cu_seqlens, as for attention).
void check_cu_seqlens(const Tensor& cu_seqlens, int64_t tokens, const Stream& stream, const char* op) {
  const std::string what = fmt::format("{}: cu_seqlens", op);
  if (stream.device().is_cpu()) {
    validate_cu_seqlens(cu_seqlens, tokens, what.c_str());
    return;
  }
  expect_defined(cu_seqlens, what);
  expect_dtype(cu_seqlens, DType::I32, what);
  check_on_stream_device(stream, cu_seqlens, op, "cu_seqlens");
  MT_CHECK(cu_seqlens.dim() == 1, "{}: expected a 1-D tensor but found {}", what, cu_seqlens.describe());
  expect_contiguous(cu_seqlens, what);
  MT_CHECK(cu_seqlens.numel() >= 2 && cu_seqlens.numel() - 1 <= tokens,
           "{}: expected between 2 and T + 1 = {} entries (1 to T documents) but found {}", what, tokens + 1,
           cu_seqlens.numel());
}

struct ConvShape {
  int64_t tokens, channels, kernel;
};

// x [T, C] (T >= 1, C >= 1) and w [C, K] (K >= 1): on the CPU in x's dtype, on CUDA in f32 or bf16.
ConvShape check_conv(const Stream& stream, const Tensor& x, const Tensor& w, GdnDTypes* dtypes, const char* op) {
  *dtypes = check_first(stream, x, op, "x");
  MT_CHECK(x.dim() == 2 && x.size(0) > 0 && x.size(1) > 0, "{}: expected x [T, C] with T, C > 0 but found {}", op,
           x.describe());
  const std::string what = fmt::format("{}: w", op);
  expect_defined(w, what);
  MT_CHECK(w.dim() == 2 && w.size(0) == x.size(1) && w.size(1) > 0,
           "{}: expected w [C = {}, K] with K > 0 (HF conv1d.weight [C, 1, K] viewed as [C, K]) but found {}", op,
           x.size(1), w.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(w.dtype() == DType::F32 || w.dtype() == DType::BF16, "{}: expected w in f32 or bf16 (CUDA) but found {}",
             op, w.describe());
  } else {
    expect_dtype(w, dtypes->act, what);
  }
  expect_contiguous(w, what);
  check_on_stream_device(stream, w, op, "w");
  return {x.size(0), x.size(1), w.size(1)};
}

struct RuleShape {
  int64_t tokens, hk, hv, dk, dv;
};

RuleShape check_rule(const Stream& stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& cu_seqlens, float scale, GdnDTypes* dtypes, const char* op) {
  *dtypes = check_first(stream, q, op, "q");
  MT_CHECK(q.dim() == 3 && q.size(0) > 0 && q.size(1) > 0 && q.size(2) > 0,
           "{}: expected q [T, Hk, dk] with every size > 0 but found {}", op, q.describe());
  const std::string what_v = fmt::format("{}: v", op);
  expect_defined(v, what_v);
  MT_CHECK(v.dim() == 3 && v.size(0) == q.size(0) && v.size(1) > 0 && v.size(2) > 0,
           "{}: expected v [T = {}, Hv, dv] with Hv, dv > 0 but found {}", op, q.size(0), v.describe());
  const RuleShape s{q.size(0), q.size(1), v.size(1), q.size(2), v.size(2)};
  MT_CHECK(s.hv % s.hk == 0,
           "{}: expected the value heads Hv = {} (v {}) to be a multiple of the key heads Hk = {} (q {})", op, s.hv,
           v.describe(), s.hk, q.describe());
  check_argument(k, q.shape(), dtypes->act, stream, op, "k");
  check_argument(v, v.shape(), dtypes->act, stream, op, "v");
  check_argument(g, {s.tokens, s.hv}, dtypes->aux, stream, op, "g");
  check_argument(beta, {s.tokens, s.hv}, dtypes->aux, stream, op, "beta");
  check_cu_seqlens(cu_seqlens, s.tokens, stream, op);
  MT_CHECK(std::isfinite(scale), "{}: expected a finite scale but found {}", op, scale);
  if (stream.device().is_cuda()) {
    MT_CHECK(
        s.dk <= 128 && s.dv <= 128,
        "{}: the CUDA kernels tile the state in shared memory for dk <= 128 and dv <= 128 but found dk = {}, dv = {}",
        op, s.dk, s.dv);
  }
  return s;
}

}  // namespace

void causal_conv1d_silu_forward(Stream& s, Tensor y, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens) {
  constexpr const char* op = "causal_conv1d_silu_forward";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes{};
  const ConvShape c = check_conv(s, x, w, &dtypes, op);
  check_argument(y, x.shape(), dtypes.act, s, op, "y");
  check_cu_seqlens(cu_seqlens, c.tokens, s, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::causal_conv1d_silu_forward(s, y, x, w, cu_seqlens);
    return;
  }
#endif
  cpu::causal_conv1d_silu_forward(y, x, w, cu_seqlens);
}

void causal_conv1d_silu_backward(Stream& s, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                                 const Tensor& cu_seqlens) {
  constexpr const char* op = "causal_conv1d_silu_backward";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes{};
  const ConvShape c = check_conv(s, x, w, &dtypes, op);
  check_argument(dy, x.shape(), dtypes.act, s, op, "dy");
  check_argument(dx, x.shape(), dtypes.act, s, op, "dx");
  check_argument(dw, w.shape(), dtypes.aux, s, op, "dw");
  check_cu_seqlens(cu_seqlens, c.tokens, s, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::causal_conv1d_silu_backward(s, dx, dw, dy, x, w, cu_seqlens);
    return;
  }
#endif
  cpu::causal_conv1d_silu_backward(dx, dw, dy, x, w, cu_seqlens);
}

void l2norm_forward(Stream& s, Tensor y, const Tensor& x, float eps) {
  constexpr const char* op = "l2norm_forward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, x, op, "x");
  check_rows(x, op, "x");
  check_argument(y, x.shape(), dtypes.act, s, op, "y");
  check_eps(eps, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::l2norm_forward(s, y, x, eps);
    return;
  }
#endif
  cpu::l2norm_forward(y, x, eps);
}

void l2norm_backward(Stream& s, Tensor dx, const Tensor& dy, const Tensor& x, float eps) {
  constexpr const char* op = "l2norm_backward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, x, op, "x");
  check_rows(x, op, "x");
  check_argument(dy, x.shape(), dtypes.act, s, op, "dy");
  check_argument(dx, x.shape(), dtypes.act, s, op, "dx");
  MT_CHECK(dx.raw_data() != dy.raw_data(), "{}: expected dx and dy in separate memory but both are at {}", op,
           dx.raw_data());
  check_eps(eps, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::l2norm_backward(s, dx, dy, x, eps);
    return;
  }
#endif
  cpu::l2norm_backward(dx, dy, x, eps);
}

void gated_delta_gates_forward(Stream& s, Tensor g, Tensor beta, const Tensor& a, const Tensor& b, const Tensor& A_log,
                               const Tensor& dt_bias) {
  constexpr const char* op = "gated_delta_gates_forward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, a, op, "a");
  MT_CHECK(a.dim() == 2 && a.size(0) > 0 && a.size(1) > 0, "{}: expected a [T, H] with T, H > 0 but found {}", op,
           a.describe());
  const int64_t tokens = a.size(0), heads = a.size(1);
  check_argument(b, a.shape(), dtypes.act, s, op, "b");
  check_argument(A_log, {heads}, dtypes.aux, s, op, "A_log");
  check_argument(dt_bias, {heads}, dtypes.aux, s, op, "dt_bias");
  check_argument(g, {tokens, heads}, dtypes.aux, s, op, "g");
  check_argument(beta, {tokens, heads}, dtypes.aux, s, op, "beta");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_delta_gates_forward(s, g, beta, a, b, A_log, dt_bias);
    return;
  }
#endif
  cpu::gated_delta_gates_forward(g, beta, a, b, A_log, dt_bias);
}

void gated_delta_gates_backward(Stream& s, Tensor da, Tensor db, Tensor dA_log, Tensor ddt_bias, const Tensor& dg,
                                const Tensor& dbeta, const Tensor& a, const Tensor& b, const Tensor& A_log,
                                const Tensor& dt_bias) {
  constexpr const char* op = "gated_delta_gates_backward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, a, op, "a");
  MT_CHECK(a.dim() == 2 && a.size(0) > 0 && a.size(1) > 0, "{}: expected a [T, H] with T, H > 0 but found {}", op,
           a.describe());
  const int64_t tokens = a.size(0), heads = a.size(1);
  check_argument(b, a.shape(), dtypes.act, s, op, "b");
  check_argument(A_log, {heads}, dtypes.aux, s, op, "A_log");
  check_argument(dt_bias, {heads}, dtypes.aux, s, op, "dt_bias");
  check_argument(dg, {tokens, heads}, dtypes.aux, s, op, "dg");
  check_argument(dbeta, {tokens, heads}, dtypes.aux, s, op, "dbeta");
  check_argument(da, a.shape(), dtypes.act, s, op, "da");
  check_argument(db, a.shape(), dtypes.act, s, op, "db");
  check_argument(dA_log, {heads}, dtypes.aux, s, op, "dA_log");
  check_argument(ddt_bias, {heads}, dtypes.aux, s, op, "ddt_bias");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_delta_gates_backward(s, da, db, dA_log, ddt_bias, dg, dbeta, a, b, A_log, dt_bias);
    return;
  }
#endif
  cpu::gated_delta_gates_backward(da, db, dA_log, ddt_bias, dg, dbeta, a, b, A_log, dt_bias);
}

void gated_delta_rule_forward(Stream& s, Tensor out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& cu_seqlens, float scale, GatedDeltaSaved* saved) {
  constexpr const char* op = "gated_delta_rule_forward";
  OpScope profile(s, "gated_delta", op);
  if (saved != nullptr) saved->tensors.clear();
  GdnDTypes dtypes{};
  check_rule(s, q, k, v, g, beta, cu_seqlens, scale, &dtypes, op);
  check_argument(out, v.shape(), dtypes.act, s, op, "out");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    // The exact lanes run the sequential scan: generation's prefill and steps run it too, so a token's output has the
    // same bytes in training, in score and in generate (the chunked form rounds at other places).
    if (batch_invariant(s)) {
      cuda::gated_delta_rule_sequential_forward(s, out, q, k, v, g, beta, cu_seqlens, scale);
      return;
    }
    cuda::gated_delta_rule_chunked_forward(s, out, q, k, v, g, beta, cu_seqlens, scale,
                                           saved == nullptr ? nullptr : &saved->tensors);
    return;
  }
#endif
  cpu::gated_delta_rule_forward(out, q, k, v, g, beta, cu_seqlens, scale);
}

void gated_delta_rule_backward(Stream& s, Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, const Tensor& dout,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& cu_seqlens, float scale, const GatedDeltaSaved* saved) {
  constexpr const char* op = "gated_delta_rule_backward";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes{};
  const RuleShape r = check_rule(s, q, k, v, g, beta, cu_seqlens, scale, &dtypes, op);
  check_argument(dout, v.shape(), dtypes.act, s, op, "dout");
  check_argument(dq, q.shape(), dtypes.act, s, op, "dq");
  check_argument(dk, q.shape(), dtypes.act, s, op, "dk");
  check_argument(dv, v.shape(), dtypes.act, s, op, "dv");
  check_argument(dg, {r.tokens, r.hv}, dtypes.aux, s, op, "dg");
  check_argument(dbeta, {r.tokens, r.hv}, dtypes.aux, s, op, "dbeta");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    if (batch_invariant(s)) {  // as its forward
      cuda::gated_delta_rule_sequential_backward(s, dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, cu_seqlens, scale);
      return;
    }
    const bool reuse = saved != nullptr && !saved->tensors.empty();
    cuda::gated_delta_rule_chunked_backward(s, dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, cu_seqlens, scale,
                                            reuse ? &saved->tensors : nullptr);
    return;
  }
#endif
  static_cast<void>(saved);  // the CPU reference keeps nothing in a forward: its backward recomputes
  cpu::gated_delta_rule_backward(dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, cu_seqlens, scale);
}

// [0, 1, ..., B] on the stream's device: generation's steps, one token per sequence.
Tensor one_token_per_document(const Stream& s, int64_t rows) {
  std::vector<int32_t> cu(static_cast<size_t>(rows + 1));
  for (int64_t b = 0; b <= rows; ++b) cu[static_cast<size_t>(b)] = static_cast<int32_t>(b);
  const Tensor host = Tensor::from_vector(cu, {rows + 1});
  return s.device().is_cpu() ? host : host.to(s.device());
}

void gated_delta_rule_prefill(Stream& s, Tensor out, Tensor final_state, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                              float scale) {
  constexpr const char* op = "gated_delta_rule_prefill";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes{};
  const RuleShape r = check_rule(s, q, k, v, g, beta, cu_seqlens, scale, &dtypes, op);
  check_argument(out, v.shape(), dtypes.act, s, op, "out");
  check_argument(final_state, {cu_seqlens.numel() - 1, r.hv, r.dk, r.dv}, dtypes.aux, s, op, "final_state");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_delta_rule_sequential_forward(s, out, q, k, v, g, beta, cu_seqlens, scale, Tensor(), final_state);
    return;
  }
#endif
  cpu::gated_delta_rule_forward(out, q, k, v, g, beta, cu_seqlens, scale, final_state);
}

void gated_delta_rule_decode(Stream& s, Tensor out, Tensor state, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, float scale) {
  constexpr const char* op = "gated_delta_rule_decode";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes{};
  const int64_t rows = q.defined() && q.dim() == 3 ? q.size(0) : 0;
  const Tensor cu = one_token_per_document(s, rows);
  const RuleShape r = check_rule(s, q, k, v, g, beta, cu, scale, &dtypes, op);
  check_argument(out, v.shape(), dtypes.act, s, op, "out");
  check_argument(state, {r.tokens, r.hv, r.dk, r.dv}, dtypes.aux, s, op, "state");
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_delta_rule_sequential_forward(s, out, q, k, v, g, beta, cu, scale, state, state);
    return;
  }
#endif
  cpu::gated_delta_rule_decode(out, state, q, k, v, g, beta, scale);
}

void causal_conv1d_silu_decode(Stream& s, Tensor y, const Tensor& history, const Tensor& w, const Tensor& lengths) {
  constexpr const char* op = "causal_conv1d_silu_decode";
  OpScope profile(s, "gated_delta", op);
  GdnDTypes dtypes = check_first(s, history, op, "history");
  MT_CHECK(history.dim() == 3 && history.size(0) > 0 && history.size(1) > 0 && history.size(2) > 0,
           "{}: expected history [B, capacity, C] with every size > 0 but found {}", op, history.describe());
  const int64_t rows = history.size(0), capacity = history.size(1), channels = history.size(2);
  check_conv(s, history.view({rows * capacity, channels}), w, &dtypes, op);
  check_argument(y, {rows, channels}, dtypes.act, s, op, "y");
  // The lengths are host-known (the decode cache counts them): checked here, uploaded for CUDA.
  const std::string what = fmt::format("{}: lengths", op);
  expect_shape(lengths, {rows}, what);
  expect_dtype(lengths, DType::I32, what);
  MT_CHECK(lengths.device().is_cpu() && lengths.is_contiguous(), "{}: expected a contiguous CPU tensor but found {}",
           what, lengths.describe());
  const int32_t* len = lengths.data<int32_t>();
  for (int64_t b = 0; b < rows; ++b) {
    MT_CHECK(len[b] >= 1 && len[b] <= capacity, "{}: lengths[{}] = {} must be in [1, capacity = {}]", op, b, len[b],
             capacity);
  }
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::causal_conv1d_silu_decode(s, y, history, w, lengths.to(s.device()));
    return;
  }
#endif
  cpu::causal_conv1d_silu_decode(y, history, w, lengths);
}

void gated_rmsnorm_forward(Stream& s, Tensor y, Tensor rstd, const Tensor& x, const Tensor& z, const Tensor& w,
                           float eps) {
  constexpr const char* op = "gated_rmsnorm_forward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, x, op, "x");
  const int64_t rows = check_rows(x, op, "x");
  check_argument(z, x.shape(), dtypes.act, s, op, "z");
  check_argument(w, {x.size(-1)}, dtypes.aux, s, op, "w");
  check_argument(y, x.shape(), dtypes.act, s, op, "y");
  check_argument(rstd, {rows}, dtypes.aux, s, op, "rstd");
  check_eps(eps, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_rmsnorm_forward(s, y, rstd, x, z, w, eps);
    return;
  }
#endif
  cpu::gated_rmsnorm_forward(y, rstd, x, z, w, eps);
}

void gated_rmsnorm_backward(Stream& s, Tensor dx, Tensor dz, Tensor dw, const Tensor& dy, const Tensor& x,
                            const Tensor& z, const Tensor& w, const Tensor& rstd, float eps) {
  constexpr const char* op = "gated_rmsnorm_backward";
  OpScope profile(s, "gated_delta", op);
  const GdnDTypes dtypes = check_first(s, x, op, "x");
  const int64_t rows = check_rows(x, op, "x");
  check_argument(z, x.shape(), dtypes.act, s, op, "z");
  check_argument(w, {x.size(-1)}, dtypes.aux, s, op, "w");
  check_argument(dy, x.shape(), dtypes.act, s, op, "dy");
  check_argument(rstd, {rows}, dtypes.aux, s, op, "rstd");
  check_argument(dx, x.shape(), dtypes.act, s, op, "dx");
  check_argument(dz, x.shape(), dtypes.act, s, op, "dz");
  check_argument(dw, {x.size(-1)}, dtypes.aux, s, op, "dw");
  check_eps(eps, op);
#if MOETRAIN_HAS_CUDA
  if (s.device().is_cuda()) {
    cuda::gated_rmsnorm_backward(s, dx, dz, dw, dy, x, z, w, rstd, eps);
    return;
  }
#endif
  cpu::gated_rmsnorm_backward(dx, dz, dw, dy, x, z, w, rstd, eps);
}

}  // namespace moetrain::ops
