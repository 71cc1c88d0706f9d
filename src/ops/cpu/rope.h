// defines: the CPU reference of rotary position embedding (ops/rope.h): the cos/sin of each token's angles are
// computed once per token (as HF does in f32) and applied to every head; tokens run in parallel.
#pragma once

#include "core/tensor.h"
#include "ops/rope.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::rope_forward / ops::rope_backward; f32 or f64, position_ids i32 >= 0.
// Both elements of a pair are read before either is written, so y may alias x (dx may alias dy).
void rope_forward(const Tensor& y, const Tensor& x, const Tensor& position_ids, const RopeParams& params);
void rope_backward(const Tensor& dx, const Tensor& dy, const Tensor& position_ids, const RopeParams& params);

}  // namespace moetrain::ops::cpu
