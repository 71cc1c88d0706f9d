// defines: the device and stream checks and the zeroing shared by the public ops (see op_checks.h).
#include "ops/op_checks.h"

#include "core/error.h"
#include "ops/cpu/dispatch.h"

#if MOETRAIN_HAS_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace moetrain::ops {

void check_stream_backend(const Stream& stream, std::string_view op) {
  MT_CHECK(stream.device().is_cpu() || (kHasCuda && stream.device().is_cuda()),
           "{}: no kernel for a {} stream in this build", op, stream.device().str());
}

void check_on_stream_device(const Stream& stream, const Tensor& t, std::string_view op, std::string_view name) {
  MT_CHECK(t.device() == stream.device(), "{}: expected {} on the stream's device {} but found {}", op, name,
           stream.device().str(), t.describe());
}

Device check_tensor_backend(const Stream& stream, const Tensor& t, std::string_view op, std::string_view name) {
  expect_defined(t, fmt::format("{}: {}", op, name));
#if MOETRAIN_HAS_CUDA
  if (on_cuda(t)) {
    MT_CHECK(stream.device() == t.device(), "{}: {} is on {} but the stream runs on {}", op, name, t.device().str(),
             stream.device().str());
    return t.device();
  }
#endif
  require_cpu(t, op);
  MT_CHECK(stream.device().is_cpu(), "{}: {} is on the CPU but the stream runs on {}", op, name, stream.device().str());
  return Device::cpu();
}

void check_on_device(const Tensor& t, Device device, std::string_view op, std::string_view name) {
  if (device.is_cpu()) {
    require_cpu(t, op);
  } else {
    MT_CHECK(t.device() == device, "{}: expected {} on {} but found {}", op, name, device.str(), t.describe());
  }
}

namespace {

// `t` has `shape` and `dtype` and is contiguous.
void check_layout(const Tensor& t, const Shape& shape, DType dtype, std::string_view op, std::string_view name) {
  const std::string what = fmt::format("{}: {}", op, name);
  expect_shape(t, shape, what);
  expect_dtype(t, dtype, what);
  expect_contiguous(t, what);
}

}  // namespace

void check_argument(const Tensor& t, const Shape& shape, DType dtype, const Stream& stream, std::string_view op,
                    std::string_view name) {
  check_layout(t, shape, dtype, op, name);
  check_on_stream_device(stream, t, op, name);
}

void check_argument(const Tensor& t, const Shape& shape, DType dtype, Device device, std::string_view op,
                    std::string_view name) {
  check_layout(t, shape, dtype, op, name);
  check_on_device(t, device, op, name);
}

void check_like(const Tensor& t, const Tensor& like, const Stream& stream, std::string_view op, std::string_view name) {
  check_argument(t, like.shape(), like.dtype(), stream, op, name);
}

bool share_memory(const Tensor& a, const Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.raw_data());
  const auto* b_begin = static_cast<const char*>(b.raw_data());
  return a.nbytes() > 0 && b.nbytes() > 0 && a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

void check_class_targets(const Tensor& targets, int64_t tokens, int64_t vocab, int ignore_index, const Stream& stream,
                         std::string_view op) {
  check_argument(targets, {tokens}, DType::I32, stream, op, "targets");
  if (targets.device().is_cuda()) return;
  const int32_t* target = targets.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    MT_CHECK(target[t] == ignore_index || (target[t] >= 0 && target[t] < vocab),
             "{}: targets[{}] = {} is outside the vocabulary [0, V = {}) and is not the ignore index {}", op, t,
             target[t], vocab, ignore_index);
  }
}

void zero_on_stream(const Stream& stream, Tensor& t) {
#if MOETRAIN_HAS_CUDA
  if (on_cuda(t)) {
    const cuda::StreamScope on_stream(stream);
    t.zero_();
    return;
  }
#endif
  (void)stream;
  t.zero_();
}

void copy_on_stream(const Stream& stream, Tensor& dst, const Tensor& src) {
#if MOETRAIN_HAS_CUDA
  if (on_cuda(dst) || on_cuda(src)) {
    const cuda::StreamScope on_stream(stream);
    dst.copy_from(src);
    return;
  }
#endif
  (void)stream;
  dst.copy_from(src);
}

}  // namespace moetrain::ops
