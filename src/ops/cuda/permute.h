// defines: the CUDA kernels' launchers of MoE token permutation (ops/permute.h): the routing plan built on the
// device without a host synchronisation, and the gather / weighted scatter-sum between token and expert order.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/permute.h"

namespace moetrain::ops::cuda {

// topk_index i32 [T, K] on the device -> a plan whose three tensors live on the same device: a stable radix sort
// (CUB) of the flat choices t*K + k by expert gives row_choice, its inverse choice_row, and a binary search per
// expert in the sorted experts gives expert_offsets. The result equals the CPU plan exactly. Every value of
// topk_index must be in [0, num_experts): the caller's contract on CUDA (the device cannot report a bad one; a
// value outside makes the plan meaningless). Scratch comes from the device's stream-ordered pool.
RoutingPlan make_routing_plan(const Stream& stream, const Tensor& topk_index, int64_t num_experts);

// The arguments (plan included) are validated by the ops:: functions of the same name; the float tensors are f32 or
// bf16 (one dtype per call), accumulated in f32. permute_forward gives a token's row to a warp, which reads it once
// and stores it to the token's K permuted rows (a thread block per row where the rows rule out 16-byte copies); the
// other ops take a thread block per output row. Sums over a token's slots run in ascending k with separately rounded
// products and sums (no fused multiply-add), so f32 results equal the CPU's bit for bit, except dtopk_weight's dot
// product over H (a fixed tree: per-thread strided sums, then the warps).
void permute_forward(const Stream& stream, const Tensor& permuted, const Tensor& x, const RoutingPlan& plan);
// A defined addend [T, H] (permute_backward_add, unpermute_forward_add) joins each token's sum after it is rounded
// to dx's (y's) dtype: the bits of the op followed by accumulate. An addend of another dtype takes those two kernels.
void permute_backward(const Stream& stream, const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan,
                      const Tensor& addend = Tensor());
void unpermute_forward(const Stream& stream, const Tensor& y, const Tensor& expert_out, const Tensor& topk_weight,
                       const RoutingPlan& plan, const Tensor& addend = Tensor());
void unpermute_backward(const Stream& stream, const Tensor& dexpert_out, const Tensor& dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan);
// A launch per source, a warp per token (its row read once, stored to its K rows): the rows land where
// concat_group_rows puts them, so the expert offsets' values stay on the device (a bad one never makes the kernel
// write outside out); each row is made with permute_forward's copy or unpermute_backward's product, so the result is
// bitwise those ops followed by concat_group_rows.
void concat_permuted_rows(const Stream& stream, const Tensor& out, const std::vector<PermutedRows>& sources);

}  // namespace moetrain::ops::cuda
