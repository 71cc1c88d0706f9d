// defines: the MoE router block: the router projection, softmax top-k, and the routing metadata
// (plan, weights, probabilities) that stage 1 produces and stage 5 consumes as one named struct.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/model_config.h"
#include "model/parameter_store.h"
#include "ops/permute.h"
#include "ops/router.h"

namespace moetrain::model {

struct RoutingMetadata {
  ops::RoutingPlan plan;  // choices grouped by expert
  Tensor logits;          // [T, E] router logits (what HF returns as router_logits)
  Tensor probs;           // [T, E] softmax
  Tensor topk_index;      // i32 [T, K]
  Tensor topk_weight;     // [T, K]
  bool defined() const { return topk_index.defined(); }
};

struct RouterRecord {
  Tensor x;         // [T, H] router input
  Tensor d_logits;  // kept by backward_input for backward_weight
};

class RouterBlock {
 public:
  RouterBlock(const io::ModelConfig& config, ParameterStore& store, const std::string& prefix);
  static void add_param_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs);

  RoutingMetadata forward(RouterRecord& record, const Tensor& x) const;
  // dx [T, H] from the gradient of the selected weights and, when defined, an extra gradient on
  // the probabilities (the load-balance loss).
  // `d_logits_extra`, when defined, is added to the logits' gradient (the z-loss).
  Tensor backward_input(RouterRecord& record, const RoutingMetadata& routing, const Tensor& d_topk_weight,
                        const Tensor& d_probs, const Tensor& d_logits_extra) const;
  void backward_weight(RouterRecord& record) const;

 private:
  int64_t num_experts_;
  ops::RouterParams params_;
  Tensor w_, g_;
};

}  // namespace moetrain::model
