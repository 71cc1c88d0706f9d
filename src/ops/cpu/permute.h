// defines: the CPU reference of MoE token permutation (ops/permute.h): the routing plan (a stable counting sort
// of the (token, slot) choices by expert) and the gather / weighted scatter-sum between token and expert order.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/permute.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of the same name; the float ops take f32 or f64.
RoutingPlan make_routing_plan(const Tensor& topk_index, int64_t num_experts);
void permute_forward(const Tensor& permuted, const Tensor& x, const RoutingPlan& plan);
void permute_backward(const Tensor& dx, const Tensor& dpermuted, const RoutingPlan& plan);
void unpermute_forward(const Tensor& y, const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan);
void unpermute_backward(const Tensor& dexpert_out, const Tensor& dtopk_weight, const Tensor& dy,
                        const Tensor& expert_out, const Tensor& topk_weight, const RoutingPlan& plan);
// Group by group, source by source: the rows of concat_group_rows' layout, each made as permute_forward (unweighted)
// or unpermute_backward's dexpert_out (weighted) makes it.
void concat_permuted_rows(const Tensor& out, const std::vector<PermutedRows>& sources);

}  // namespace moetrain::ops::cpu
