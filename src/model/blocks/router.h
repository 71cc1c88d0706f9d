// defines: Router, the MoE router block driven by RouterOptions: the router projection, scores, top-k selection and
// the routing metadata (plan, weights, probabilities) that stage 1 produces and stage 5 consumes as one named
// struct. It runs softmax scores with greedy or group-limited top-k (DeepSeek-V2), renormalisation and a routed
// scaling factor, or GPT-OSS's top-k over the logits then a softmax over the k kept (ops/router.h), with an optional
// bias on the projection; sigmoid scores are refused by name when the block is built. It knows no HF names.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/parameter_store.h"
#include "ops/permute.h"
#include "ops/router.h"

namespace moetrain::model {

enum class RouterScore : uint8_t { Softmax, Sigmoid };

struct RouterOptions {
  int64_t hidden_size = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  RouterScore score = RouterScore::Softmax;
  bool topk_before_softmax = false;  // top-k over the logits, then a softmax over the k kept
  bool bias = false;                 // a bias on the router projection
  int64_t num_groups = 1;            // group-limited top-k: experts in num_groups contiguous groups,
  int64_t topk_groups = 1;           // of which the topk_groups best (by their best score) are kept
  bool renormalize = false;          // divide the k selected weights by their sum (norm_topk_prob)
  double scaling_factor = 1.0;       // multiplies the selected weights, after renormalisation (routed_scaling_factor)
};

struct RoutingMetadata {
  ops::RoutingPlan plan;  // choices grouped by expert
  Tensor logits;          // [T, E] router logits (what HF returns as router_logits)
  Tensor probs;           // [T, E] scores
  Tensor topk_index;      // i32 [T, K]
  Tensor topk_weight;     // [T, K]
  bool defined() const { return topk_index.defined(); }
};

struct RouterRecord {
  Tensor x;             // [T, H] router input
  Tensor d_logits;      // kept by backward_input for backward_weight
  bool pinned = false;  // the forward took its selection from pinned logits (weighed without the group mask)
};

class Router {
 public:
  // "<prefix>router" [E, H] and, with a bias, "<prefix>router_bias" [E] (N(0, std) at init); role Router, in decoder
  // layer `layer`. No HF pieces.
  static std::vector<ParamSpec> param_specs(const RouterOptions& options, const std::string& prefix, int64_t layer);

  Router(const RouterOptions& options, ParameterStore& store, const std::string& prefix);

  const RouterOptions& options() const { return options_; }
  // `pinned` (may be undefined): router logits [T, E] of another run to select the experts from instead of this
  // router's own (MicroBatch::pinned_routing); the weights still come from this router's logits.
  RoutingMetadata forward(RouterRecord& record, const Tensor& x, const Tensor& pinned) const;
  // dx [T, H] from the gradient of the selected weights and, when defined, an extra gradient on
  // the probabilities (the load-balance loss).
  // `d_logits_extra`, when defined, is added to the logits' gradient (the z-loss).
  Tensor backward_input(RouterRecord& record, const RoutingMetadata& routing, const Tensor& d_topk_weight,
                        const Tensor& d_probs, const Tensor& d_logits_extra) const;
  void backward_weight(RouterRecord& record) const;

 private:
  RouterOptions options_;
  ops::RouterParams params_;
  // params_ without the group mask: a pinned selection was made under the other run's mask, so its experts are weighed
  // by their probabilities (under ours, a selection wholly outside our kept groups would weigh 0 / 0).
  ops::RouterParams pinned_params_;
  Tensor w_, g_, w_bias_, g_bias_;
  GradientWriter writer_;  // the weight gradient's first write of a step overwrites
};

}  // namespace moetrain::model
