// defines: the public chunked linear cross-entropy: argument validation (shapes, dtypes, contiguity, devices, every
// CPU target inside [0, V) or the ignore index) and the driver shared by both backends: the chunk GEMMs through
// ops::gemm, the per-row steps through the CPU reference or the CUDA kernels.
#include "ops/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/linear_cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/linear_cross_entropy.h"
#endif

namespace moetrain::ops {

namespace {

constexpr const char* kForward = "linear_cross_entropy_forward";
constexpr const char* kForwardBackward = "linear_cross_entropy_forward_backward";

// The dtype of the per-row statistics, losses and lse: x's on the CPU, f32 on CUDA.
DType row_dtype(const Tensor& x) { return x.device().is_cuda() ? DType::F32 : x.dtype(); }

// x [T, K] and w [V, K] with V > 0, one dtype: f32 or f64 on the CPU, f32 or bf16 on CUDA.
void check_inputs(const Tensor& x, const Tensor& w, int64_t chunk, const Stream& stream, const char* op) {
  check_stream_backend(stream, op);
  expect_contiguous(x, fmt::format("{}: x", op));
  expect_contiguous(w, fmt::format("{}: w", op));
  check_on_stream_device(stream, x, op, "x");
  check_on_stream_device(stream, w, op, "w");
  MT_CHECK(x.dim() == 2, "{}: expected x [T, K] but found {}", op, x.describe());
  MT_CHECK(w.dim() == 2 && w.size(0) > 0 && w.size(1) == x.size(1),
           "{}: expected w [V, K = {}] with V > 0 but found {}", op, x.size(1), w.describe());
  MT_CHECK(w.dtype() == x.dtype(), "{}: expected w in x's dtype {} but found {}", op, dtype_name(x.dtype()),
           w.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, "{}: expected x in f32 or bf16 (CUDA) but found {}",
             op, x.describe());
  } else {
    MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F64, "{}: expected x in f32 or f64 but found {}", op,
             x.describe());
  }
  MT_CHECK(chunk > 0, "{}: expected a chunk width > 0 but found {}", op, chunk);
}

void chunk_stats(Stream& stream, const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                 const Tensor& logits, const Tensor& targets, int64_t begin, bool first, int ignore_index) {
#if MOETRAIN_HAS_CUDA
  if (logits.device().is_cuda()) {
    cuda::linear_cross_entropy_chunk_stats(stream, row_max, row_sum, target_logit, logits, targets, begin, first,
                                           ignore_index);
    return;
  }
#endif
  (void)stream;
  cpu::linear_cross_entropy_chunk_stats(row_max, row_sum, target_logit, logits, targets, begin, first, ignore_index);
}

void finish(Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& row_sum,
            const Tensor& target_logit, const Tensor& targets, int ignore_index) {
#if MOETRAIN_HAS_CUDA
  if (lse.device().is_cuda()) {
    cuda::linear_cross_entropy_finish(stream, losses, lse, row_max, row_sum, target_logit, targets, ignore_index);
    return;
  }
#endif
  (void)stream;
  cpu::linear_cross_entropy_finish(losses, lse, row_max, row_sum, target_logit, targets, ignore_index);
}

void chunk_gradient(Stream& stream, const Tensor& logits, const Tensor& lse, const Tensor& targets, int64_t begin,
                    int64_t vocab, double scale, int ignore_index) {
#if MOETRAIN_HAS_CUDA
  if (logits.device().is_cuda()) {
    cuda::linear_cross_entropy_chunk_gradient(stream, logits, lse, targets, begin, vocab, scale, ignore_index);
    return;
  }
#endif
  (void)stream;
  (void)vocab;  // the CPU targets were validated against [0, V)
  cpu::linear_cross_entropy_chunk_gradient(logits, lse, targets, begin, scale, ignore_index);
}

// The shared driver; dx / dw undefined for the forward only. Arguments validated by the callers.
void run(Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& dx, const Tensor& dw, const Tensor& x,
         const Tensor& w, const Tensor& targets, double scale, int64_t chunk, int ignore_index) {
  const int64_t tokens = x.size(0);
  const int64_t hidden = x.size(1);
  const int64_t vocab = w.size(0);
  if (tokens == 0) return;  // no losses, an empty dx, nothing added to dw
  const Device device = x.device();
  const int64_t width = std::min(chunk, vocab);
  const int64_t chunks = (vocab + width - 1) / width;
  const Tensor row_max = Tensor::empty({tokens}, row_dtype(x), device);
  const Tensor row_sum = Tensor::empty({tokens}, row_dtype(x), device);
  const Tensor target_logit = Tensor::empty({tokens}, row_dtype(x), device);
  const Tensor scratch = Tensor::empty({tokens * width}, x.dtype(), device);
  // Chunk c: columns [begin, begin + n) of the logits, in the first tokens * n elements of the scratch.
  auto columns = [&](int64_t c) { return std::pair<int64_t, int64_t>{c * width, std::min(width, vocab - c * width)}; };
  auto logits_of = [&](int64_t n) { return scratch.slice(0, tokens * n).view({tokens, n}); };

  for (int64_t c = 0; c < chunks; ++c) {
    const auto [begin, n] = columns(c);
    const Tensor logits = logits_of(n);
    gemm(stream, logits, x, Transpose::No, w.slice(begin, begin + n), Transpose::Yes);
    chunk_stats(stream, row_max, row_sum, target_logit, logits, targets, begin, c == 0, ignore_index);
  }
  finish(stream, losses, lse, row_max, row_sum, target_logit, targets, ignore_index);
  if (!dx.defined()) return;

  // bf16 dx: accumulate in an f32 buffer and round once at the end, not once per chunk.
  const bool f32_accumulator = dx.dtype() == DType::BF16;
  const Tensor dx_acc = f32_accumulator ? Tensor::empty({tokens, hidden}, DType::F32, device) : dx;
  for (int64_t c = chunks; c-- > 0;) {  // the last chunk's logits are still in the scratch
    const auto [begin, n] = columns(c);
    const Tensor logits = logits_of(n);
    const Tensor w_c = w.slice(begin, begin + n);
    if (c != chunks - 1) gemm(stream, logits, x, Transpose::No, w_c, Transpose::Yes);
    chunk_gradient(stream, logits, lse, targets, begin, vocab, scale, ignore_index);
    gemm(stream, dx_acc, logits, Transpose::No, w_c, Transpose::No, 1.0, c == chunks - 1 ? 0.0 : 1.0);
    gemm(stream, dw.slice(begin, begin + n), logits, Transpose::Yes, x, Transpose::No, 1.0, 1.0);
  }
  if (f32_accumulator) cast(stream, dx, dx_acc);
}

}  // namespace

void linear_cross_entropy_forward(Stream& stream, Tensor losses, Tensor lse, const Tensor& x, const Tensor& w,
                                  const Tensor& targets, int64_t chunk, int ignore_index) {
  OpScope profile(stream, "loss", kForward);
  check_inputs(x, w, chunk, stream, kForward);
  const int64_t tokens = x.size(0);
  check_argument(losses, {tokens}, row_dtype(x), stream, kForward, "losses");
  check_argument(lse, {tokens}, row_dtype(x), stream, kForward, "lse");
  check_class_targets(targets, tokens, w.size(0), ignore_index, stream, kForward);
  run(stream, losses, lse, Tensor(), Tensor(), x, w, targets, 0.0, chunk, ignore_index);
}

void linear_cross_entropy_forward_backward(Stream& stream, Tensor losses, Tensor lse, Tensor dx, Tensor dw,
                                           const Tensor& x, const Tensor& w, const Tensor& targets, double scale,
                                           int64_t chunk, int ignore_index) {
  OpScope profile(stream, "loss", kForwardBackward);
  constexpr const char* op = kForwardBackward;
  check_inputs(x, w, chunk, stream, op);
  const int64_t tokens = x.size(0);
  check_argument(losses, {tokens}, row_dtype(x), stream, op, "losses");
  check_argument(lse, {tokens}, row_dtype(x), stream, op, "lse");
  check_argument(dx, x.shape(), x.dtype(), stream, op, "dx");
  check_argument(dw, w.shape(), stream.device().is_cuda() ? DType::F32 : x.dtype(), stream, op, "dw");
  check_class_targets(targets, tokens, w.size(0), ignore_index, stream, op);
  MT_CHECK(std::isfinite(scale), "{}: expected a finite scale but found {}", op, scale);
  run(stream, losses, lse, dx, dw, x, w, targets, scale, chunk, ignore_index);
}

}  // namespace moetrain::ops
