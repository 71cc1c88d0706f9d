// defines: MoE token permutation. The T*K (token, slot) choices of the router are grouped by
// expert into a routing plan; tokens are copied into expert order before the expert MLP and the
// expert outputs are combined back, weighted by the router, afterwards.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct RoutingPlan {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t num_experts = 0;
  Tensor expert_offsets;  // i32 [E + 1]: permuted rows of expert e are [offsets[e], offsets[e + 1])
  Tensor row_choice;      // i32 [T*K]: the flat choice t*K + k that each permuted row holds
  Tensor choice_row;      // i32 [T*K]: the permuted row of each flat choice t*K + k
};

// Groups choices by expert; within an expert, choices keep ascending (t, k) order (a stable sort),
// so the plan is a function of topk_index alone. topk_index i32 [T, K], values in [0, E).
RoutingPlan make_routing_plan(Stream& stream, const Tensor& topk_index, int64_t num_experts);

// permuted [T*K, H]: row r = x[row_choice[r] / K]
void permute_forward(Stream& stream, Tensor permuted, const Tensor& x, const RoutingPlan& plan);
// dx [T, H] = sum over k (ascending) of dpermuted[choice_row[t*K + k]]
void permute_backward(Stream& stream, Tensor dx, const Tensor& dpermuted, const RoutingPlan& plan);
// y [T, H] = sum over k (ascending) of weight[t, k] * expert_out[choice_row[t*K + k]]. The routing
// weights (topk_weight, dtopk_weight) are f32 on CUDA whatever the activations' dtype. On CUDA the token side (dx of
// permute_backward, y here, dy below) may be f32 while the rows are bf16: an f32 residual stream under bf16 compute.
void unpermute_forward(Stream& stream, Tensor y, const Tensor& expert_out, const Tensor& topk_weight,
                       const RoutingPlan& plan);
// permute_backward and unpermute_forward with an addend [T, H] (the router's input gradient; the residual) added in
// the same pass: each token's sum is rounded to dx's (y's) dtype, then the addend added and rounded again, the bits
// of the op followed by accumulate(dx, addend) on either backend. The addend (on CUDA f32 or bf16, on the CPU in
// dx's dtype) must not share memory with dx (y).
void permute_backward_add(Stream& stream, Tensor dx, const Tensor& dpermuted, const RoutingPlan& plan,
                          const Tensor& addend);
void unpermute_forward_add(Stream& stream, Tensor y, const Tensor& expert_out, const Tensor& topk_weight,
                           const RoutingPlan& plan, const Tensor& addend);
// dexpert_out [T*K, H] and dtopk_weight [T, K] from dy [T, H]
void unpermute_backward(Stream& stream, Tensor dexpert_out, Tensor dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan);

// One micro-batch's permuted rows given by the token-side tensor they are made from, for a reader that would
// otherwise hold the rows: row r of the plan is tokens[c / K], c = plan.row_choice[r] (permute_forward's row), or
// with a weight, weight[c] * tokens[c / K] rounded once to the rows' dtype (unpermute_backward's dexpert_out row, dy
// the tokens). tokens [T, H]. weight [T, K] or undefined: f32 on CUDA, the tokens' dtype on the CPU. On CUDA weighted
// tokens may be f32 beside bf16 rows (an f32 residual stream's gradient); unweighted ones have the rows' dtype.
struct PermutedRows {
  Tensor tokens;
  Tensor weight;
  RoutingPlan plan;
};
// out [R_0 + R_1 + ..., H], R_p = T_p * K_p: the sources' rows laid out as concat_group_rows lays out expert-ordered
// parts by their plans' expert offsets (expert e's rows of source 0, then of source 1, ...), each made from its token
// side in the one pass: the bits of permute_forward (unpermute_backward's dexpert_out) on each source followed by
// concat_group_rows, without the per-source rows in memory. 1 to kMaxGroupParts sources (ops/row_gather.h), all
// weighted or none, with one E and one H. The expert weight gradients once a step read a micro-batch's input rows
// and output-row gradients this way instead of holding them (model/blocks/gated_mlp.h).
void concat_permuted_rows(Stream& stream, Tensor out, const std::vector<PermutedRows>& sources);

}  // namespace moetrain::ops
