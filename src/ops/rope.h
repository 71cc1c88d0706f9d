// defines: rotary position embedding, driven by per-token position_ids (positions restart in each
// packed document), over rotary_dim dims of each head (the first ones unless told; partial rotary leaves the rest);
// its parameters for the default rope and for YaRN, as transformers 5.17 computes them (modeling_rope_utils.py).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RopeParams {
  // Rotated dims of each head: even, <= head dim. HF: int(head_dim * partial_rotary_factor) (DeepSeek-V2:
  // qk_rope_head_dim).
  int rotary_dim = 0;
  // The first rotated dim of each head: the rotation covers dims [first_rotated_dim, first_rotated_dim + rotary_dim)
  // and leaves the others. 0 for every family's keys and queries but DeepSeek-V2's queries, whose projection puts
  // the rope dims after the nope dims of each head (rotated in place there, so the queries need no reordering).
  int first_rotated_dim = 0;
  // Pairing of the rotated dims. false: rotate_half pairs (i, i + rotary_dim/2) (Llama, Qwen, GPT-OSS);
  // true: (2i, 2i+1) (DeepSeek-V2's complex view_as_complex pairs).
  bool interleaved = false;
  // Multiplies cos and sin: HF's RotaryEmbedding.attention_scaling, the second value its rope init function returns
  // (1 for the default rope, YaRN's attention factor), applied as f32 (cos * python float in torch).
  float attention_scaling = 1.0f;
  // rotary_dim / 2 frequencies, f32 as HF's inv_freq buffer; the angle of pair i is f32(position * inv_freq[i]).
  std::vector<float> inv_freq;
};

// The default (unscaled) rope of HF: inv_freq[i] = 1 / theta^(2i / rotary_dim), computed in f32.
RopeParams rope_default_params(int rotary_dim, double theta);

// YaRN (arXiv 2309.00071): the keys transformers 5.17's _compute_yarn_parameters reads from a "yarn"
// rope_parameters dict, with its defaults. A config reader maps the JSON onto these fields:
// - `factor` (required here): the context extension factor. When a config leaves it null, transformers uses
//   max_position_embeddings / original_max_position_embeddings; the reader passes that ratio.
// - `original_max_position_embeddings` (required): the pretraining context length.
// - `beta_fast`, `beta_slow`: the rotation counts bounding the ramp (default 32 and 1). transformers reads
//   them with `or`, so a 0 or null in a config means the default; the reader passes the default then (0 is refused).
// - `mscale`, `mscale_all_dim`: absent in transformers is None; here 0 means absent (transformers tests them for
//   truthiness, so None and 0 behave the same). Only when both are non-zero is the attention factor
//   get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); otherwise it is get_mscale(factor), `mscale`
//   alone being ignored. DeepSeek-V2 (and V3): mscale = mscale_all_dim (0.707 or 1), so the factor is 1 and the
//   temperature goes into the softmax scale instead (yarn_softmax_scale).
// - `attention_factor`: when set, it is the attention factor as given, overriding the above.
// - `truncate` (default true): floor / ceil the ramp bounds to whole dims. GPT-OSS's config sets false.
//   transformers 5.17 reads it from the config's top-level rope_parameters even for per-layer-type dicts.
struct YarnOptions {
  double factor = 0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 0;
  double mscale_all_dim = 0;
  std::optional<double> attention_factor;
  bool truncate = true;
};

// transformers' get_mscale: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1 (in double, that order).
double yarn_get_mscale(double scale, double mscale = 1.0);

// The attention factor (a Python float in transformers) that YaRN's cos and sin are multiplied by, as described at
// YarnOptions. Validates the options like rope_yarn_params.
double yarn_attention_factor(const YarnOptions& options);

// YaRN's inv_freq and attention factor, each step in transformers' dtypes (f32 tensors; scalars cast to f32 by the
// tensor ops; the ramp bounds in double):
//   pos_freqs[i]  = f32(theta) ^ (f32(2i) / rotary_dim)                         (as rope_default_params)
//   extrap[i]     = 1 / pos_freqs[i],  interp[i] = 1 / (f32(factor) * pos_freqs[i])
//   low, high     = rotary_dim * ln(original / (beta * 2 pi)) / (2 ln theta) for beta_fast, beta_slow;
//                   floor / ceil when truncate; low = max(low, 0), high = min(high, rotary_dim - 1);
//                   high += 0.001 when they are equal
//   ramp[i]       = clamp((f32(i) - f32(low)) / f32(high - low), 0, 1),  e[i] = 1 - ramp[i]
//   inv_freq[i]   = interp[i] * (1 - e[i]) + extrap[i] * e[i]
// attention_scaling = f32(yarn_attention_factor(options)); interleaved is false (the caller sets it per family).
// The pow is rounded once from double: torch's own f32 pow (libm powf, or SIMD Sleef pow on chunks of two vectors,
// so dependent on the CPU) can differ by an ulp on some elements; tests/data/rope_yarn shows where.
// Refuses an odd or non-positive rotary_dim, theta <= 1 (ln theta divides), factor < 1, a non-positive original
// length, non-positive betas or beta_fast < beta_slow (transformers warns about those), negative mscales, and a
// non-positive attention_factor; every message names the field.
RopeParams rope_yarn_params(int rotary_dim, double theta, const YarnOptions& options);

// The softmax scale of DeepSeek-V2 (also DeepSeek-V3, Mistral4, LongCat-Flash) under a non-default rope: its
// yarn_apply_mscale multiplies `scaling` (qk_head_dim ** -0.5) by m * m, m = yarn_get_mscale(factor,
// mscale_all_dim), as (scaling * m) * m, when mscale_all_dim is non-zero; otherwise `scaling` unchanged. GPT-OSS does
// not do this (its scale stays head_dim ** -0.5; its YaRN factor scales cos and sin instead).
double yarn_softmax_scale(double scaling, const YarnOptions& options);

// x, y [T, heads, hd]; position_ids i32 [T]. y may alias x (in place, the dims outside the rotation are not
// touched). Angles are f32(position * inv_freq) as HF computes them; cos and sin of that angle.
void rope_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& position_ids, const RopeParams& params);
// The transpose of the rotation. dx may alias dy.
void rope_backward(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& position_ids, const RopeParams& params);

// The argument checks of rope_forward (out = y, in = x) and rope_backward (out = dx, in = dy) under the name `op`,
// with the names the message gives out and in: for the ops that fuse a rotation into another kernel (ops/norm_rope.h).
void check_rope_arguments(const Tensor& out, const Tensor& in, const Tensor& position_ids, const RopeParams& params,
                          const Stream& stream, const char* op, const char* out_name, const char* in_name);

}  // namespace moetrain::ops
