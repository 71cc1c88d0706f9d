// defines: the MoE router after its linear projection: softmax over experts, top-k selection (greedy, or
// group-limited as DeepSeek-V2's group_limited_greedy), optional renormalisation and scaling of the selected
// weights, or GPT-OSS's top-k over the logits followed by a softmax over the k kept, and the backward to the router
// logits.
#pragma once

#include <cstdint>
#include <string>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RouterParams {
  int top_k = 1;
  bool renormalize = false;  // divide the k selected probabilities by their sum (norm_topk_prob)
  // Group-limited top-k (DeepSeek-V2's n_group / topk_group): the E experts form num_groups contiguous groups of
  // E / num_groups; only the topk_groups best groups (by their largest probability) are eligible. With
  // num_groups == 1 (topk_groups == 1 then means all groups) the selection is the plain greedy top-k.
  int num_groups = 1;
  int topk_groups = 1;
  double scaling_factor = 1.0;  // multiplies the selected weights, after any renormalisation (routed_scaling_factor)
  // GPT-OSS (transformers' GptOssTopKRouter): the top-k of the logits, then a softmax over the k kept. It takes no
  // renormalize, no scaling_factor other than 1 and no groups.
  bool topk_before_softmax = false;
};

// Refuses, naming the value and prefixing `what`, a top_k outside [1, E], num_groups < 1 or not dividing E,
// topk_groups outside [1, num_groups], a top_k over the topk_groups * E / num_groups experts of the kept groups, and
// a scaling_factor that is not finite and > 0, and topk_before_softmax together with renormalize, a scaling_factor
// other than 1 or num_groups other than 1. The ops run it on every call; blocks run it when they are built.
void check_router_params(const RouterParams& params, int64_t experts, const std::string& what);

// logits [T, E] -> probs [T, E] (softmax), topk_index i32 [T, K], topk_weight [T, K].
// Selection: with groups, a group's score is the largest probability in it; the topk_groups groups of the
// highest scores are kept (equal scores pick the lower group index first) and the probabilities outside them are
// masked to 0.0, as transformers' DeepSeek-V2 gate does (masked_fill(..., 0.0)). Then the top-k of the (masked)
// scores in descending order; equal scores pick the lower expert index first. Because masked scores are 0.0, a
// masked expert is selected only when fewer than K kept experts have a non-zero probability (the softmax
// underflowed); its weight is then 0 and it carries no gradient. topk_weight holds the selected scores, divided by
// their sum when renormalising, then multiplied by scaling_factor.
// With topk_before_softmax, probs is still the softmax over all E experts (the load-balance losses read it, as
// transformers' load_balancing_loss_func softmaxes the router logits), topk_index is the top-k of the logits
// (descending; equal logits pick the lower expert index first) and topk_weight the softmax over the k selected
// logits, exp(l_s - l_0) / sum_s' exp(l_s' - l_0) with l_0 the largest, summed in slot order.
void router_forward(Stream& stream, Tensor probs, Tensor topk_index, Tensor topk_weight, const Tensor& logits,
                    const RouterParams& params);
// router_forward with the selection given instead of made: topk_index [T, K] (an input) names each token's experts,
// and probs and topk_weight are computed for them exactly as router_forward computes them for its own selection (a
// group mask in params still zeroes the score of an expert outside the token's kept groups, and a renormalised
// selection wholly outside them divides 0 by 0: to weigh a selection made elsewhere, pass params without groups, as
// the router block does; GPT-OSS's k-softmax shifts by the largest kept logit). With topk_index = router_forward's own
// output, the outputs are router_forward's bit for bit. check-golden's routing pinned to the reference's choices runs
// it (cli/check_golden.cpp). The CPU refuses an index outside [0, E) or repeated in a row; on CUDA that is the caller's
// contract.
void router_forward_given(Stream& stream, Tensor probs, const Tensor& topk_index, Tensor topk_weight,
                          const Tensor& logits, const RouterParams& params);
// dlogits [T, E] from dtopk_weight [T, K] plus, when defined, dprobs [T, E] (a gradient on the full
// probabilities, e.g. from the load-balance loss), through the renormalisation, the scaling and the softmax. The
// selection itself (group mask included) carries no gradient. probs, topk_index and topk_weight must be
// router_forward's outputs for the same params (the group mask is recomputed from probs). With topk_before_softmax,
// dlogits is the gradient through the k-softmax into the selected logits, w_s (dw_s - sum_s' w_s' dw_s'), plus, when
// dprobs is defined, the full softmax's gradient of dprobs.
void router_backward(Stream& stream, Tensor dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params);

}  // namespace moetrain::ops
