// defines: the CUDA kernels' launchers of the MoE router (ops/router.h): softmax over experts, greedy or
// group-limited top-k selection, renormalisation and scaling forward, and the backward to the logits; one warp per
// token.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/router.h"

namespace moetrain::ops::cuda {

// The arguments are validated by ops::router_forward / ops::router_backward; every float tensor is f32 (the
// router's softmax and its selection run in f32 whatever the model's compute dtype). Every reduction over experts
// or slots has a fixed order (lane-strided partial sums, then a butterfly over the warp), so a token's routing
// never depends on the other tokens. The selection compares the probabilities as stored (the logits themselves with
// topk_before_softmax, GPT-OSS, whose k kept are then softmaxed by lane 0 in slot order): descending score, equal
// scores by ascending expert index, and with a group mask equal group scores by ascending group index (the CPU
// rules). num_groups is at most 1024 here (the group scores live in shared memory).
// `given`: topk_index is an input (router_forward_given; its values in [0, E), distinct per row: the caller's
// contract), not written.
void router_forward(const Stream& stream, const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                    const Tensor& logits, const RouterParams& params, bool given);
// dprobs may be undefined. topk_index's values must be in [0, E) (the caller's contract: the device cannot report
// one that is not; router_forward's output always is).
void router_backward(const Stream& stream, const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs,
                     const Tensor& probs, const Tensor& topk_index, const Tensor& topk_weight,
                     const RouterParams& params);

}  // namespace moetrain::ops::cuda
