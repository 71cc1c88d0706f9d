// defines: the router block's parameter, forward and split backward.
#include "model/router_block.h"

#include <fmt/format.h>

#include "model/precision.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace moetrain::model {

void RouterBlock::add_param_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs) {
  const Shape shape{config.num_experts, config.hidden_size};
  specs.push_back({fmt::format("layers.{}.router", layer),
                   shape,
                   {{fmt::format("model.layers.{}.mlp.gate.weight", layer), shape, 0}}});
}

RouterBlock::RouterBlock(const io::ModelConfig& config, ParameterStore& store, const std::string& prefix)
    : num_experts_(config.num_experts) {
  params_.top_k = static_cast<int>(config.num_experts_per_tok);
  params_.renormalize = config.norm_topk_prob;
  w_ = store.weight(prefix + "router");
  g_ = store.grad(prefix + "router");
}

RoutingMetadata RouterBlock::forward(RouterRecord& r, const Tensor& x) const {
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0);
  r.x = x;
  RoutingMetadata m;
  const DType route_dtype = statistics_dtype(x.dtype());
  m.logits = Tensor::empty({T, num_experts_}, route_dtype, x.device());
  m.probs = Tensor::empty({T, num_experts_}, route_dtype, x.device());
  m.topk_index = Tensor::empty({T, params_.top_k}, DType::I32, x.device());
  m.topk_weight = Tensor::empty({T, params_.top_k}, route_dtype, x.device());
  ops::linear_forward(s, m.logits, x, w_);
  ops::router_forward(s, m.probs, m.topk_index, m.topk_weight, m.logits, params_);
  m.plan = ops::make_routing_plan(s, m.topk_index, num_experts_);
  return m;
}

Tensor RouterBlock::backward_input(RouterRecord& r, const RoutingMetadata& m, const Tensor& d_topk_weight,
                                   const Tensor& d_probs, const Tensor& d_logits_extra) const {
  Stream& s = default_stream(r.x.device());
  r.d_logits = Tensor::empty(m.logits.shape(), m.logits.dtype(), m.logits.device());
  ops::router_backward(s, r.d_logits, d_topk_weight, d_probs, m.probs, m.topk_index, m.topk_weight, params_);
  if (d_logits_extra.defined()) ops::accumulate(s, r.d_logits, d_logits_extra);
  if (r.d_logits.dtype() != r.x.dtype()) {  // the GEMMs take operands of one dtype
    Tensor rounded = Tensor::empty(r.d_logits.shape(), r.x.dtype(), r.x.device());
    ops::cast(s, rounded, r.d_logits);
    r.d_logits = rounded;
  }
  Tensor dx = Tensor::empty(r.x.shape(), r.x.dtype(), r.x.device());
  ops::linear_backward_input(s, dx, r.d_logits, w_);
  return dx;
}

void RouterBlock::backward_weight(RouterRecord& r) const {
  ops::linear_backward_weight(default_stream(r.x.device()), g_, r.d_logits, r.x);
  r = RouterRecord{};
}

}  // namespace moetrain::model
