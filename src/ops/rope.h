// defines: rotary position embedding, driven by per-token position_ids (positions restart in each
// packed document), over the first rotary_dim dims of each head (partial rotary leaves the rest).
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RopeParams {
  int rotary_dim = 0;              // even, <= head dim
  bool interleaved = false;        // false: rotate_half pairs (i, i + rotary_dim/2); true: (2i, 2i+1)
  float attention_scaling = 1.0f;  // multiplies cos and sin (YaRN's mscale); 1 for default rope
  std::vector<float> inv_freq;     // rotary_dim / 2 frequencies
};

// The default (unscaled) rope of HF: inv_freq[i] = 1 / theta^(2i / rotary_dim), computed in f32.
RopeParams rope_default_params(int rotary_dim, double theta);

// x, y [T, heads, hd]; position_ids i32 [T]. y may alias x. Angles are f32(position * inv_freq)
// as HF computes them; cos and sin of that angle.
void rope_forward(Stream& stream, Tensor y, const Tensor& x, const Tensor& position_ids, const RopeParams& params);
// The transpose of the rotation. dx may alias dy.
void rope_backward(Stream& stream, Tensor dx, const Tensor& dy, const Tensor& position_ids, const RopeParams& params);

}  // namespace moetrain::ops
