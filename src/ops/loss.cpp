// defines: the public cross-entropy ops: argument validation (shapes, dtypes, contiguity, devices, every CPU target
// inside [0, V) or equal to the ignore index) and dispatch to the backend of the stream's device: the CPU
// reference, or the CUDA kernels.
#include "ops/loss.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/loss.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/loss.h"
#endif

namespace moetrain::ops {

namespace {

// The dtype of the per-token losses and lse: the logits' on the CPU, f32 on CUDA.
DType row_dtype(const Tensor& logits) { return logits.device().is_cuda() ? DType::F32 : logits.dtype(); }

// logits [T, V] with V > 0, in f32 or f64 on the CPU, f32 or bf16 on CUDA; fixes T, V and the dtype.
void check_logits(const Tensor& logits, const Stream& stream, const char* op) {
  expect_contiguous(logits, fmt::format("{}: logits", op));
  check_on_stream_device(stream, logits, op, "logits");
  MT_CHECK(logits.dim() == 2 && logits.size(1) > 0, "{}: expected logits [T, V] with V > 0 but found {}", op,
           logits.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(logits.dtype() == DType::F32 || logits.dtype() == DType::BF16,
             "{}: expected logits in f32 or bf16 (CUDA) but found {}", op, logits.describe());
    return;
  }
  MT_CHECK(logits.dtype() == DType::F32 || logits.dtype() == DType::F64,
           "{}: expected logits in f32 or f64 but found {}", op, logits.describe());
}

// The arguments every cross-entropy op over [T, V] logits shares: the logits, the targets and, when defined, the
// per-token losses and lse [T] and the logits' gradient [T, V] with its finite scale.
struct LossArguments {
  const Tensor* losses = nullptr;
  const Tensor* lse = nullptr;
  const Tensor* dlogits = nullptr;
  double scale = 0.0;
};

void check_loss_arguments(const Stream& stream, const Tensor& logits, const Tensor& targets, int ignore_index,
                          const LossArguments& a, const char* op) {
  check_stream_backend(stream, op);
  check_logits(logits, stream, op);
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (a.losses != nullptr) check_argument(*a.losses, {tokens}, row_dtype(logits), stream, op, "losses");
  if (a.lse != nullptr) check_argument(*a.lse, {tokens}, row_dtype(logits), stream, op, "lse");
  if (a.dlogits != nullptr) {
    check_argument(*a.dlogits, {tokens, vocab}, logits.dtype(), stream, op, "dlogits");
    MT_CHECK(std::isfinite(a.scale), "{}: expected a finite scale but found {}", op, a.scale);
  }
  check_class_targets(targets, tokens, vocab, ignore_index, stream, op);
}

}  // namespace

void cross_entropy_forward(Stream& stream, Tensor losses, Tensor lse, const Tensor& logits, const Tensor& targets,
                           int ignore_index) {
  OpScope profile(stream, "loss", "cross_entropy_forward");
  check_loss_arguments(stream, logits, targets, ignore_index, {&losses, &lse, nullptr, 0.0}, "cross_entropy_forward");
#if MOETRAIN_HAS_CUDA
  if (logits.device().is_cuda()) {
    cuda::cross_entropy_forward(stream, losses, lse, logits, targets, ignore_index);
    return;
  }
#endif
  cpu::cross_entropy_forward(losses, lse, logits, targets, ignore_index);
}

void cross_entropy_backward(Stream& stream, Tensor dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index) {
  OpScope profile(stream, "loss", "cross_entropy_backward");
  check_loss_arguments(stream, logits, targets, ignore_index, {nullptr, &lse, &dlogits, scale},
                       "cross_entropy_backward");
#if MOETRAIN_HAS_CUDA
  if (logits.device().is_cuda()) {
    cuda::cross_entropy_backward(stream, dlogits, logits, lse, targets, scale, ignore_index);
    return;
  }
#endif
  cpu::cross_entropy_backward(dlogits, logits, lse, targets, scale, ignore_index);
}

void cross_entropy_forward_backward(Stream& stream, Tensor losses, Tensor lse, Tensor dlogits, const Tensor& logits,
                                    const Tensor& targets, double scale, int ignore_index) {
  OpScope profile(stream, "loss", "cross_entropy_forward_backward");
  check_loss_arguments(stream, logits, targets, ignore_index, {&losses, &lse, &dlogits, scale},
                       "cross_entropy_forward_backward");
#if MOETRAIN_HAS_CUDA
  if (logits.device().is_cuda()) {
    cuda::cross_entropy_forward_backward(stream, losses, lse, dlogits, logits, targets, scale, ignore_index);
    return;
  }
#endif
  // The reference is the two ops in turn: the forward has read every row before the backward overwrites any.
  cpu::cross_entropy_forward(losses, lse, logits, targets, ignore_index);
  cpu::cross_entropy_backward(dlogits, logits, lse, targets, scale, ignore_index);
}

namespace {

void check_totals_arguments(const Stream& stream, const Tensor& losses, const Tensor& targets, const char* op) {
  check_stream_backend(stream, op);
  expect_contiguous(losses, fmt::format("{}: losses", op));
  check_on_stream_device(stream, losses, op, "losses");
  MT_CHECK(losses.dim() == 1, "{}: expected losses [T] but found {}", op, losses.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(losses.dtype() == DType::F32, "{}: expected losses in f32 (CUDA) but found {}", op, losses.describe());
  } else {
    MT_CHECK(losses.dtype() == DType::F32 || losses.dtype() == DType::F64,
             "{}: expected losses in f32 or f64 but found {}", op, losses.describe());
  }
  check_argument(targets, {losses.size(0)}, DType::I32, stream, op, "targets");
}

}  // namespace

Tensor cross_entropy_totals_pending(Stream& stream, const Tensor& losses, const Tensor& targets, int ignore_index) {
  constexpr const char* op = "cross_entropy_totals";
  OpScope profile(stream, "loss", op);
  check_totals_arguments(stream, losses, targets, op);
  Tensor totals = Tensor::empty({2}, DType::F64, losses.device());
#if MOETRAIN_HAS_CUDA
  if (losses.device().is_cuda()) {
    cuda::cross_entropy_totals(stream, totals, losses, targets, ignore_index);
    return totals;
  }
#endif
  const LossTotals host = cpu::cross_entropy_totals(losses, targets, ignore_index);
  double* out = totals.data<double>();
  out[0] = host.sum;
  out[1] = static_cast<double>(host.count);
  return totals;
}

std::vector<LossTotals> read_loss_totals(Stream& stream, const std::vector<Tensor>& pending) {
  if (pending.empty()) return {};
  const int64_t n = static_cast<int64_t>(pending.size());
  Tensor gathered = Tensor::empty({n, 2}, DType::F64, stream.device());
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = pending[static_cast<size_t>(i)];
    MT_CHECK(t.dtype() == DType::F64 && t.numel() == 2 && t.device() == stream.device(),
             "read_loss_totals: expected totals f64 [2] on {} (cross_entropy_totals_pending) but entry {} is {}",
             stream.device().str(), i, t.describe());
    Tensor row = gathered.select(i);
    copy_on_stream(stream, row, t.view({2}));
  }
  Tensor on_host = gathered;
  if (!gathered.device().is_cpu()) {
    on_host = Tensor::empty({n, 2}, DType::F64, Device::cpu());
    copy_on_stream(stream, on_host, gathered);  // waits for the stream (a copy to the host is read right after)
  }
  const std::vector<double> host = on_host.to_vector<double>();
  std::vector<LossTotals> totals(static_cast<size_t>(n));
  for (size_t i = 0; i < totals.size(); ++i) totals[i] = {host[2 * i], static_cast<int64_t>(host[2 * i + 1])};
  return totals;
}

LossTotals cross_entropy_totals(Stream& stream, const Tensor& losses, const Tensor& targets, int ignore_index) {
  return read_loss_totals(stream, {cross_entropy_totals_pending(stream, losses, targets, ignore_index)}).front();
}

}  // namespace moetrain::ops
