// defines: the public cross-entropy ops: argument validation (shapes, dtypes, contiguity, devices, every target
// inside [0, V) or equal to the ignore index) and dispatch to the CPU reference.
#include "ops/loss.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/dispatch.h"
#include "ops/cpu/loss.h"

namespace moetrain::ops {

namespace {

void check_stream(const Stream& stream, const char* op) {
  MT_CHECK(stream.device().is_cpu(), "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const char* op, const char* name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
  require_cpu(t, op);
}

// logits [T, V] in f32 or f64 with V > 0; fixes T, V and the dtype.
void check_logits(const Tensor& logits, const char* op) {
  expect_contiguous(logits, fmt::format("{}: logits", op));
  require_cpu(logits, op);
  MT_CHECK(logits.dim() == 2 && logits.size(1) > 0, "{}: expected logits [T, V] with V > 0 but found {}", op,
           logits.describe());
  MT_CHECK(logits.dtype() == DType::F32 || logits.dtype() == DType::F64,
           "{}: expected logits in f32 or f64 but found {}", op, logits.describe());
}

// targets i32 [T]; with vocab > 0 every entry must be in [0, vocab) or equal to ignore_index.
void check_targets(const Tensor& targets, int64_t tokens, int64_t vocab, int ignore_index, const char* op) {
  check_argument(targets, {tokens}, DType::I32, op, "targets");
  const int32_t* target = targets.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    MT_CHECK(target[t] == ignore_index || (target[t] >= 0 && target[t] < vocab),
             "{}: targets[{}] = {} is outside the vocabulary [0, V = {}) and is not the ignore index {}", op, t,
             target[t], vocab, ignore_index);
  }
}

}  // namespace

void cross_entropy_forward(Stream& stream, Tensor losses, Tensor lse, const Tensor& logits, const Tensor& targets,
                           int ignore_index) {
  constexpr const char* op = "cross_entropy_forward";
  check_stream(stream, op);
  check_logits(logits, op);
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  check_argument(losses, {tokens}, logits.dtype(), op, "losses");
  check_argument(lse, {tokens}, logits.dtype(), op, "lse");
  check_targets(targets, tokens, vocab, ignore_index, op);
  cpu::cross_entropy_forward(losses, lse, logits, targets, ignore_index);
}

void cross_entropy_backward(Stream& stream, Tensor dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index) {
  constexpr const char* op = "cross_entropy_backward";
  check_stream(stream, op);
  check_logits(logits, op);
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  check_argument(dlogits, {tokens, vocab}, logits.dtype(), op, "dlogits");
  check_argument(lse, {tokens}, logits.dtype(), op, "lse");
  check_targets(targets, tokens, vocab, ignore_index, op);
  MT_CHECK(std::isfinite(scale), "{}: expected a finite scale but found {}", op, scale);
  cpu::cross_entropy_backward(dlogits, logits, lse, targets, scale, ignore_index);
}

LossTotals cross_entropy_totals(Stream& stream, const Tensor& losses, const Tensor& targets, int ignore_index) {
  constexpr const char* op = "cross_entropy_totals";
  check_stream(stream, op);
  expect_contiguous(losses, fmt::format("{}: losses", op));
  require_cpu(losses, op);
  MT_CHECK(losses.dim() == 1, "{}: expected losses [T] but found {}", op, losses.describe());
  MT_CHECK(losses.dtype() == DType::F32 || losses.dtype() == DType::F64,
           "{}: expected losses in f32 or f64 but found {}", op, losses.describe());
  check_argument(targets, {losses.size(0)}, DType::I32, op, "targets");
  return cpu::cross_entropy_totals(losses, targets, ignore_index);
}

}  // namespace moetrain::ops
