// defines: the public attention ops: argument validation (shapes, dtypes, devices, cu_seqlens) and dispatch to
// the backend: the CPU reference (f32 or f64) or, for CUDA tensors, cuDNN's fused SDPA (bf16, (hd, hdv) in (64, 64),
// (128, 128) or (192, 128), max_seqlen known, a sliding window only when causal; never under the exact lanes'
// batch-invariant policy) or else our CUDA kernels (f32 or bf16, lse in f32); and the attention sinks applied to the
// attention's results (CPU reference or CUDA kernels).
#include "ops/attention.h"

#include <cstdint>
#include <string>

#include "ops/cpu/attention.h"
#include "ops/cpu/attention_sinks.h"
#include "ops/cpu/dispatch.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/attention.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_decode.h"
#include "ops/cuda/attention_sinks.h"
#endif

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
  if (q.device().is_cuda()) {
    MT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16, "{}: expected q in f32 or bf16 on CUDA but found {}",
             op, q.describe());
  } else {
    MT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::F64, "{}: expected q in f32 or f64 but found {}", op,
             q.describe());
  }
  return s;
}

// The dtype of lse: f32 on CUDA (whatever q's), that of q on the CPU.
DType lse_dtype(const Tensor& q) { return q.device().is_cuda() ? DType::F32 : q.dtype(); }

// Shape, dtype, contiguity and device of one tensor argument; `device` is that of the argument `picked_by`.
void check_argument(const Tensor& t, const Shape& shape, DType dtype, Device device, const char* op, const char* name,
                    const char* picked_by = "q") {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  if (device.is_cpu()) {
    require_cpu(t, op);
  } else {
    MT_CHECK(t.device() == device, "{}: expected {} on {} (the device of {}) but found {}", op, name, device.str(),
             picked_by, t.describe());
  }
}

// cu_seqlens for the backend of q: fully validated on the CPU; on CUDA its values live on the device, where the host
// cannot read them, so only its dtype, shape and device are checked here and its values are the caller's contract
// (validate_cu_seqlens on the host copy before the upload). A strictly increasing run from 0 to T has at most T
// documents, which the shape alone can check.
void check_cu_seqlens(const Tensor& cu_seqlens, int64_t tokens, Device device, const char* what) {
  if (device.is_cpu()) {
    validate_cu_seqlens(cu_seqlens, tokens, what);
    return;
  }
  expect_defined(cu_seqlens, what);
  expect_dtype(cu_seqlens, DType::I32, what);
  MT_CHECK(cu_seqlens.device() == device, "{}: expected a tensor on {} (the device of q) but found {}", what,
           device.str(), cu_seqlens.describe());
  MT_CHECK(cu_seqlens.dim() == 1, "{}: expected a 1-D tensor but found {}", what, cu_seqlens.describe());
  expect_contiguous(cu_seqlens, what);
  MT_CHECK(cu_seqlens.numel() >= 2 && cu_seqlens.numel() - 1 <= tokens,
           "{}: expected between 2 and T + 1 = {} entries (1 to T documents) but found {}", what, tokens + 1,
           cu_seqlens.numel());
}

// max_seqlen must lie in [0, T]; on the CPU, where cu_seqlens (already validated) is readable, a known max_seqlen
// must also cover the longest document.
void check_params(const AttentionParams& params, int64_t tokens, const Tensor& cu_seqlens, const char* op) {
  MT_CHECK(params.sliding_window >= 0, "{}: sliding_window must be >= 0 (0 = unlimited) but found {}", op,
           params.sliding_window);
  MT_CHECK(params.max_seqlen >= 0 && params.max_seqlen <= tokens,
           "{}: max_seqlen must be in [0, T = {}] (0 = unknown) but found {}", op, tokens, params.max_seqlen);
  if (params.max_seqlen > 0 && cu_seqlens.device().is_cpu()) {
    const int32_t* cu = cu_seqlens.data<int32_t>();
    for (int64_t d = 0; d + 1 < cu_seqlens.numel(); ++d) {
      MT_CHECK(cu[d + 1] - cu[d] <= params.max_seqlen,
               "{}: max_seqlen ({}) must cover the longest document but document {} has {} tokens", op,
               params.max_seqlen, d, cu[d + 1] - cu[d]);
    }
  }
}

// The arguments of the sink ops: out [T, nh, hdv] picks the backend and the dtypes (CPU: f32 or f64 for everything;
// CUDA: out / dout f32 or bf16, lse and sinks f32); lse [T, nh], sinks [nh]. Returns out's extents.
AttentionShape check_sinks(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                           const char* op, Device* device) {
  *device = check_tensor_backend(stream, out, op, "out");
  MT_CHECK(out.dim() == 3, "{}: expected out [T, nh, hdv] but found {}", op, out.describe());
  if (device->is_cuda()) {
    MT_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::BF16,
             "{}: expected out in f32 or bf16 on CUDA but found {}", op, out.describe());
  } else {
    MT_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::F64, "{}: expected out in f32 or f64 but found {}", op,
             out.describe());
  }
  const AttentionShape s{out.size(0), out.size(1), 0, 0, out.size(2)};
  check_argument(out, {s.tokens, s.nh, s.hdv}, out.dtype(), *device, op, "out", "out");
  check_argument(lse, {s.tokens, s.nh}, lse_dtype(out), *device, op, "lse", "out");
  check_argument(sinks, {s.nh}, lse_dtype(out), *device, op, "sinks", "out");
  return s;
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
  constexpr const char* op = "attention_forward";
  OpScope profile(stream, "attention", op);
  const AttentionShape s = check_qkv(q, k, v, op);
  const Device device = check_tensor_backend(stream, q, op, "q");
  const DType dtype = q.dtype();
  check_argument(q, {s.tokens, s.nh, s.hd}, dtype, device, op, "q");
  check_argument(k, {s.tokens, s.nkv, s.hd}, dtype, device, op, "k");
  check_argument(v, {s.tokens, s.nkv, s.hdv}, dtype, device, op, "v");
  check_argument(out, {s.tokens, s.nh, s.hdv}, dtype, device, op, "out");
  check_argument(lse, {s.tokens, s.nh}, lse_dtype(q), device, op, "lse");
  check_cu_seqlens(cu_seqlens, s.tokens, device, "attention_forward: cu_seqlens");
  check_params(params, s.tokens, cu_seqlens, op);
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    // The exact lanes run our kernels: their reduction order per query depends only on its document (cuDNN's is not
    // certified independent of the document's offset in the packed run), and their backward has no atomics.
    if (!batch_invariant(stream) && cuda::cudnn_attention_supports(dtype, s.hd, s.hdv, params)) {
      cuda::cudnn_attention_forward(stream, out, lse, q, k, v, cu_seqlens, params);
      return;
    }
    cuda::attention_forward(stream, out, lse, q, k, v, cu_seqlens, params);
    return;
  }
#endif
  cpu::attention_forward(out, lse, q, k, v, cu_seqlens, params);
}

void attention_backward(Stream& stream, Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params) {
  constexpr const char* op = "attention_backward";
  OpScope profile(stream, "attention", op);
  const AttentionShape s = check_qkv(q, k, v, op);
  const Device device = check_tensor_backend(stream, q, op, "q");
  const DType dtype = q.dtype();
  check_argument(q, {s.tokens, s.nh, s.hd}, dtype, device, op, "q");
  check_argument(k, {s.tokens, s.nkv, s.hd}, dtype, device, op, "k");
  check_argument(v, {s.tokens, s.nkv, s.hdv}, dtype, device, op, "v");
  check_argument(out, {s.tokens, s.nh, s.hdv}, dtype, device, op, "out");
  check_argument(lse, {s.tokens, s.nh}, lse_dtype(q), device, op, "lse");
  check_argument(dout, {s.tokens, s.nh, s.hdv}, dtype, device, op, "dout");
  check_argument(dq, {s.tokens, s.nh, s.hd}, dtype, device, op, "dq");
  check_argument(dk, {s.tokens, s.nkv, s.hd}, dtype, device, op, "dk");
  check_argument(dv, {s.tokens, s.nkv, s.hdv}, dtype, device, op, "dv");
  check_cu_seqlens(cu_seqlens, s.tokens, device, "attention_backward: cu_seqlens");
  check_params(params, s.tokens, cu_seqlens, op);
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    if (!batch_invariant(stream) && cuda::cudnn_attention_backward_supports(dtype, s.hd, s.hdv, params)) {
      cuda::cudnn_attention_backward(stream, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params);
      return;
    }
    cuda::attention_backward(stream, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params);
    return;
  }
#endif
  cpu::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, params);
}

void attention_decode_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params) {
  constexpr const char* op = "attention_decode_forward";
  OpScope profile(stream, "attention", op);
  const Device device = check_tensor_backend(stream, q, op, "q");
  MT_CHECK(q.dim() == 3, "{}: expected q [B, nh, hd] but found {}", op, q.describe());
  MT_CHECK(k_cache.dim() == 4, "{}: expected k_cache [B, C, nkv, hd] but found {}", op, k_cache.describe());
  MT_CHECK(v_cache.dim() == 4, "{}: expected v_cache [B, C, nkv, hdv] but found {}", op, v_cache.describe());
  if (device.is_cuda()) {
    MT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16, "{}: expected q in f32 or bf16 on CUDA but found {}",
             op, q.describe());
  } else {
    MT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::F64, "{}: expected q in f32 or f64 but found {}", op,
             q.describe());
  }
  const int64_t rows = q.size(0), nh = q.size(1), hd = q.size(2), capacity = k_cache.size(1), nkv = k_cache.size(2),
                hdv = v_cache.size(3);
  MT_CHECK(nkv > 0 && nh % nkv == 0, "{}: the query heads (nh = {}) must be a multiple of the kv heads (nkv = {})", op,
           nh, nkv);
  check_argument(q, {rows, nh, hd}, q.dtype(), device, op, "q");
  check_argument(k_cache, {rows, capacity, nkv, hd}, q.dtype(), device, op, "k_cache");
  check_argument(v_cache, {rows, capacity, nkv, hdv}, q.dtype(), device, op, "v_cache");
  check_argument(out, {rows, nh, hdv}, q.dtype(), device, op, "out");
  check_argument(lse, {rows, nh}, lse_dtype(q), device, op, "lse");
  // The lengths are host-known (the decode cache counts them): checked here, uploaded for CUDA.
  check_argument(lengths, {rows}, DType::I32, Device::cpu(), op, "lengths", "the host");
  MT_CHECK(params.causal, "{}: decoding is causal (a token sees its prefix), but params.causal is false", op);
  MT_CHECK(params.sliding_window >= 0, "{}: sliding_window must be >= 0 (0 = unlimited) but found {}", op,
           params.sliding_window);
  const int32_t* len = lengths.data<int32_t>();
  for (int64_t b = 0; b < rows; ++b) {
    MT_CHECK(len[b] >= 1 && len[b] <= capacity, "{}: lengths[{}] = {} must be in [1, C = {}] (the cached rows)", op, b,
             len[b], capacity);
  }
  if (rows == 0 || nh == 0) return;
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::attention_decode_forward(stream, out, lse, q, k_cache, v_cache, lengths.to(device), params);
    return;
  }
#endif
  cpu::attention_decode_forward(out, lse, q, k_cache, v_cache, lengths, params);
}

void attention_sinks_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& sinks) {
  constexpr const char* op = "attention_sinks_forward";
  OpScope profile(stream, "attention", op);
  Device device;
  const AttentionShape s = check_sinks(stream, out, lse, sinks, op, &device);
  if (s.tokens == 0 || s.nh == 0) return;
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::attention_sinks_forward(stream, out, lse, sinks);
    return;
  }
#endif
  cpu::attention_sinks_forward(out, lse, sinks);
}

void attention_sinks_backward(Stream& stream, Tensor dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& sinks) {
  constexpr const char* op = "attention_sinks_backward";
  OpScope profile(stream, "attention", op);
  Device device;
  const AttentionShape s = check_sinks(stream, out, lse, sinks, op, &device);
  check_argument(dout, out.shape(), out.dtype(), device, op, "dout", "out");
  check_argument(dsinks, {s.nh}, sinks.dtype(), device, op, "dsinks", "out");
  if (s.tokens == 0 || s.nh == 0) return;  // dsinks += an empty sum
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    cuda::attention_sinks_backward(stream, dsinks, dout, out, lse, sinks);
    return;
  }
#endif
  cpu::attention_sinks_backward(dsinks, dout, out, lse, sinks);
}

}  // namespace moetrain::ops
