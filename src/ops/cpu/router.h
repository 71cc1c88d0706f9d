// defines: the CPU reference of the MoE router (ops/router.h): softmax over experts, the group mask of
// group-limited top-k (ties to the lower group index), top-k with ties to the lower expert index, optional
// renormalisation, the scaling factor, GPT-OSS's top-k over the logits with a softmax over the k kept, and the
// backward to the logits.
#pragma once

#include "core/tensor.h"
#include "ops/router.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::router_forward(_given) / ops::router_backward; f32 or f64. `given`:
// topk_index is an input (router_forward_given), not written.
void router_forward(const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight, const Tensor& logits,
                    const RouterParams& params, bool given);
// dprobs may be undefined (no gradient on the full probabilities).
void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_index, const Tensor& topk_weight, const RouterParams& params);

}  // namespace moetrain::ops::cpu
