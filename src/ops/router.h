// defines: the MoE router after its linear projection: softmax over experts, top-k selection and
// optional renormalisation of the selected weights, and the backward to the router logits.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RouterParams {
  int top_k = 1;
  bool renormalize = false;  // divide the k selected probabilities by their sum (norm_topk_prob)
};

// logits [T, E] -> probs [T, E] (softmax), topk_index i32 [T, K] (descending probability; equal
// probabilities pick the lower expert index first), topk_weight [T, K] (probabilities of the
// selected experts, renormalised when asked).
void router_forward(Stream& stream, Tensor probs, Tensor topk_index, Tensor topk_weight, const Tensor& logits,
                    const RouterParams& params);
// dlogits [T, E] from dtopk_weight [T, K] plus, when defined, dprobs [T, E] (a gradient on the full
// probabilities, e.g. from the load-balance loss). The selection itself carries no gradient.
void router_backward(Stream& stream, Tensor dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params);

}  // namespace moetrain::ops
