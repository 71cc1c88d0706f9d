// defines: the public rope ops: HF's default and YaRN parameters, argument validation (shapes, dtypes, rotary_dim, the
// frequency count, non-negative i32 positions for CPU positions) and dispatch to the backend of the stream's device:
// the CPU reference, or the CUDA kernels.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>

#include "ops/cpu/rope.h"
#include "ops/op_checks.h"
#include "ops/op_profile.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/rope.h"
#endif

namespace moetrain::ops {

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
  MT_CHECK(params.first_rotated_dim >= 0 && params.first_rotated_dim <= head_dim - params.rotary_dim,
           "{}: the rotated dims [{}, {}) (first_rotated_dim {}, rotary_dim {}) do not fit the head dim ({}) of {} {}",
           op, params.first_rotated_dim, int64_t{params.first_rotated_dim} + params.rotary_dim,
           params.first_rotated_dim, params.rotary_dim, head_dim, in_name, in.describe());
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

namespace {

// HF's base ** (torch.arange(0, dim, 2).float() / dim): every step in f32 (base is cast to f32 by the tensor op).
// pow is evaluated in double and rounded once, the closest to torch's result (which is libm powf or SIMD Sleef pow
// depending on the CPU and the element: an ulp apart on some elements).
std::vector<float> rope_pos_freqs(int rotary_dim, double theta) {
  std::vector<float> power(static_cast<size_t>(rotary_dim / 2));
  const double base = static_cast<double>(static_cast<float>(theta));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    power[static_cast<size_t>(i)] = static_cast<float>(std::pow(base, static_cast<double>(exponent)));
  }
  return power;
}

void check_yarn_options(const YarnOptions& o, const char* op) {
  MT_CHECK(std::isfinite(o.factor) && o.factor >= 1.0,
           "{}: expected a finite YaRN factor >= 1 but found {} (a config without one: pass max_position_embeddings / "
           "original_max_position_embeddings)",
           op, o.factor);
  MT_CHECK(o.original_max_position_embeddings > 0, "{}: expected original_max_position_embeddings > 0 but found {}", op,
           o.original_max_position_embeddings);
  MT_CHECK(std::isfinite(o.beta_fast) && o.beta_fast > 0.0,
           "{}: expected a finite beta_fast > 0 but found {} (transformers reads 0 or null as the default 32)", op,
           o.beta_fast);
  MT_CHECK(std::isfinite(o.beta_slow) && o.beta_slow > 0.0,
           "{}: expected a finite beta_slow > 0 but found {} (transformers reads 0 or null as the default 1)", op,
           o.beta_slow);
  MT_CHECK(o.beta_fast >= o.beta_slow, "{}: expected beta_fast ({}) >= beta_slow ({})", op, o.beta_fast, o.beta_slow);
  MT_CHECK(std::isfinite(o.mscale) && o.mscale >= 0.0, "{}: expected a finite mscale >= 0 (0: absent) but found {}", op,
           o.mscale);
  MT_CHECK(std::isfinite(o.mscale_all_dim) && o.mscale_all_dim >= 0.0,
           "{}: expected a finite mscale_all_dim >= 0 (0: absent) but found {}", op, o.mscale_all_dim);
  if (o.attention_factor) {
    MT_CHECK(std::isfinite(*o.attention_factor) && *o.attention_factor > 0.0,
             "{}: expected a finite attention_factor > 0 but found {}", op, *o.attention_factor);
  }
}

// transformers' find_correction_dim: the dim (of `dim`) whose wavelength turns `num_rotations` times over
// `max_position_embeddings` positions, in double and in its order of operations.
double yarn_correction_dim(double num_rotations, int dim, double base, int64_t max_position_embeddings) {
  const double rotations = num_rotations * 2.0 * std::numbers::pi;
  return (static_cast<double>(dim) * std::log(static_cast<double>(max_position_embeddings) / rotations)) /
         (2.0 * std::log(base));
}

}  // namespace

RopeParams rope_default_params(int rotary_dim, double theta) {
  MT_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope_default_params: expected an even rotary_dim > 0 but found {}",
           rotary_dim);
  MT_CHECK(std::isfinite(theta) && theta > 0.0, "rope_default_params: expected a finite rope theta > 0 but found {}",
           theta);
  // HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)).
  RopeParams params;
  params.rotary_dim = rotary_dim;
  params.inv_freq = rope_pos_freqs(rotary_dim, theta);
  for (float& f : params.inv_freq) f = 1.0f / f;
  return params;
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_attention_factor(const YarnOptions& options) {
  check_yarn_options(options, "yarn_attention_factor");
  if (options.attention_factor) return *options.attention_factor;
  if (options.mscale != 0.0 && options.mscale_all_dim != 0.0) {
    return yarn_get_mscale(options.factor, options.mscale) / yarn_get_mscale(options.factor, options.mscale_all_dim);
  }
  return yarn_get_mscale(options.factor);
}

RopeParams rope_yarn_params(int rotary_dim, double theta, const YarnOptions& options) {
  constexpr const char* op = "rope_yarn_params";
  MT_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "{}: expected an even rotary_dim > 0 but found {}", op, rotary_dim);
  MT_CHECK(std::isfinite(theta) && theta > 1.0,
           "{}: expected a finite rope theta > 1 (YaRN divides by ln theta) but found {}", op, theta);
  check_yarn_options(options, op);

  RopeParams params;
  params.rotary_dim = rotary_dim;
  params.attention_scaling = static_cast<float>(yarn_attention_factor(options));

  // The ramp bounds (Python floats; ints when truncated, which changes no value).
  double low = yarn_correction_dim(options.beta_fast, rotary_dim, theta, options.original_max_position_embeddings);
  double high = yarn_correction_dim(options.beta_slow, rotary_dim, theta, options.original_max_position_embeddings);
  if (options.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rotary_dim - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  // torch casts the Python scalars to f32 in the tensor ops: (arange - f32(low)) / f32(high - low).
  const float ramp_low = static_cast<float>(low);
  const float ramp_width = static_cast<float>(high - low);

  const float factor = static_cast<float>(options.factor);
  const std::vector<float> pos_freqs = rope_pos_freqs(rotary_dim, theta);
  params.inv_freq.resize(pos_freqs.size());
  for (size_t i = 0; i < pos_freqs.size(); ++i) {
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (factor * pos_freqs[i]);
    const float ramp = std::clamp((static_cast<float>(i) - ramp_low) / ramp_width, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    // Two products and a sum, each rounded to f32 (-ffp-contract=off: no fused multiply-add), as torch's eager ops.
    const float interpolated = interpolation * (1.0f - extrapolation_factor);
    const float extrapolated = extrapolation * extrapolation_factor;
    params.inv_freq[i] = interpolated + extrapolated;
  }
  return params;
}

double yarn_softmax_scale(double scaling, const YarnOptions& options) {
  check_yarn_options(options, "yarn_softmax_scale");
  if (options.mscale_all_dim == 0.0) return scaling;
  const double m = yarn_get_mscale(options.factor, options.mscale_all_dim);
  return scaling * m * m;
}

void rope_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& position_ids, const RopeParams& params) {
  constexpr const char* op = "rope_forward";
  OpScope profile(stream, "rope", op);
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
  constexpr const char* op = "rope_backward";
  OpScope profile(stream, "rope", op);
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
