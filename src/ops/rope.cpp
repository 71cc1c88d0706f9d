// defines: the public rope ops: HF's default inv_freq, argument validation (shapes, dtypes, rotary_dim, the
// frequency count, non-negative i32 positions for CPU positions) and dispatch to the backend of the stream's device:
// the CPU reference, or the CUDA kernels.
#include "ops/rope.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cpu/rope.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/rope.h"
#endif

namespace moetrain::ops {

namespace {

// Validates every argument of a rope op: `in` fixes [T, heads, hd] and the dtype, `out` must match it.
void check_rope_arguments(const Tensor& out, const Tensor& in, const Tensor& position_ids, const RopeParams& params,
                          const Stream& stream, const char* op, const char* out_name, const char* in_name) {
  const std::string in_what = fmt::format("{}: {}", op, in_name);
  const std::string out_what = fmt::format("{}: {}", op, out_name);
  const std::string pos_what = fmt::format("{}: position_ids", op);
  expect_contiguous(in, in_what);
  check_on_stream_device(stream, in, op, in_name);
  MT_CHECK(in.dim() == 3, "{}: expected {} [T, heads, hd] but found {}", op, in_name, in.describe());
  if (stream.device().is_cuda()) {
    MT_CHECK(in.dtype() == DType::F32 || in.dtype() == DType::BF16,
             "{}: expected {} in f32 or bf16 (CUDA) but found {}", op, in_name, in.describe());
  } else {
    MT_CHECK(in.dtype() == DType::F32 || in.dtype() == DType::F64, "{}: expected {} in f32 or f64 but found {}", op,
             in_name, in.describe());
  }
  expect_shape(out, in.shape(), out_what);
  expect_dtype(out, in.dtype(), out_what);
  expect_contiguous(out, out_what);
  check_on_stream_device(stream, out, op, out_name);
  expect_shape(position_ids, {in.size(0)}, pos_what);
  expect_dtype(position_ids, DType::I32, pos_what);
  expect_contiguous(position_ids, pos_what);
  check_on_stream_device(stream, position_ids, op, "position_ids");

  const int64_t head_dim = in.size(2);
  MT_CHECK(params.rotary_dim > 0 && params.rotary_dim % 2 == 0, "{}: expected an even rotary_dim > 0 but found {}", op,
           params.rotary_dim);
  MT_CHECK(params.rotary_dim <= head_dim, "{}: rotary_dim ({}) exceeds the head dim ({}) of {} {}", op,
           params.rotary_dim, head_dim, in_name, in.describe());
  MT_CHECK(static_cast<int64_t>(params.inv_freq.size()) == params.rotary_dim / 2,
           "{}: expected rotary_dim / 2 = {} inv_freq values but found {}", op, params.rotary_dim / 2,
           params.inv_freq.size());
  MT_CHECK(std::isfinite(params.attention_scaling), "{}: expected a finite attention_scaling but found {}", op,
           params.attention_scaling);

#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    MT_CHECK(params.rotary_dim / 2 <= cuda::kRopeMaxFrequencies,
             "{}: the CUDA kernel takes at most {} frequencies (rotary_dim {}) but rotary_dim is {}", op,
             cuda::kRopeMaxFrequencies, 2 * cuda::kRopeMaxFrequencies, params.rotary_dim);
    // Positions on the device are not read here (that would copy device memory to the host inside an op): the
    // trainer builds them on the host; a negative one only rotates the other way (ops/cuda/rope.h).
    return;
  }
#endif
  const int32_t* positions = position_ids.data<int32_t>();
  for (int64_t t = 0; t < position_ids.numel(); ++t) {
    MT_CHECK(positions[t] >= 0, "{}: position_ids[{}] is {}; positions must be >= 0", op, t, positions[t]);
  }
}

}  // namespace

RopeParams rope_default_params(int rotary_dim, double theta) {
  MT_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope_default_params: expected an even rotary_dim > 0 but found {}",
           rotary_dim);
  MT_CHECK(std::isfinite(theta) && theta > 0.0, "rope_default_params: expected a finite rope theta > 0 but found {}",
           theta);
  // HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), every step in f32 (base is
  // cast to f32 by the tensor op). pow is evaluated in double and rounded once, the closest to torch's result.
  RopeParams params;
  params.rotary_dim = rotary_dim;
  params.inv_freq.resize(static_cast<size_t>(rotary_dim / 2));
  const double base = static_cast<double>(static_cast<float>(theta));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    const float power = static_cast<float>(std::pow(base, static_cast<double>(exponent)));
    params.inv_freq[static_cast<size_t>(i)] = 1.0f / power;
  }
  return params;
}

void rope_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& position_ids, const RopeParams& params) {
  OpScope profile(stream, "rope");
  constexpr const char* op = "rope_forward";
  check_stream_backend(stream, op);
  check_rope_arguments(y, x, position_ids, params, stream, op, "y", "x");
#if MOETRAIN_HAS_CUDA
  if (x.device().is_cuda()) {
    cuda::rope_forward(stream, y, x, position_ids, params);
    return;
  }
#endif
  cpu::rope_forward(y, x, position_ids, params);
}

void rope_backward(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& position_ids, const RopeParams& params) {
  OpScope profile(stream, "rope");
  constexpr const char* op = "rope_backward";
  check_stream_backend(stream, op);
  check_rope_arguments(dx, dy, position_ids, params, stream, op, "dx", "dy");
#if MOETRAIN_HAS_CUDA
  if (dy.device().is_cuda()) {
    cuda::rope_backward(stream, dx, dy, position_ids, params);
    return;
  }
#endif
  cpu::rope_backward(dx, dy, position_ids, params);
}

}  // namespace moetrain::ops
