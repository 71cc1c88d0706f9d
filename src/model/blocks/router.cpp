// defines: the router block's parameter, forward and split backward; its options are checked when it is built.
#include "model/blocks/router.h"

#include "core/error.h"
#include "model/precision.h"
#include "ops/bias.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace moetrain::model {

std::vector<ParamSpec> Router::param_specs(const RouterOptions& o, const std::string& prefix, int64_t layer) {
  ParamSpec spec;
  spec.name = prefix + "router";
  spec.shape = {o.num_experts, o.hidden_size};
  spec.role = ParamRole::Router;
  spec.layer = layer;
  if (!o.bias) return {spec};
  ParamSpec bias = spec;
  bias.name = prefix + "router_bias";
  bias.shape = {o.num_experts};
  bias.init = ParamInit::Normal;  // as transformers' GPT-OSS router: N(0, std), like the weight
  return {spec, bias};
}

Router::Router(const RouterOptions& options, ParameterStore& store, const std::string& prefix) : options_(options) {
  MT_CHECK(options.num_experts > 0 && options.top_k > 0 && options.top_k <= options.num_experts,
           "router block: top-{} of {} experts: expected 0 < k <= E", options.top_k, options.num_experts);
  MT_CHECK(options.score == RouterScore::Softmax, "router block: sigmoid scores are not supported yet");
  // int64 options into the op's int parameters: both group counts are in [1, E] when valid.
  MT_CHECK(options.num_groups >= 1 && options.num_groups <= options.num_experts,
           "router block: num_groups ({}) must be in [1, E = {}]", options.num_groups, options.num_experts);
  MT_CHECK(options.topk_groups >= 1 && options.topk_groups <= options.num_groups,
           "router block: topk_groups ({}) must be in [1, num_groups = {}]", options.topk_groups, options.num_groups);
  params_.top_k = static_cast<int>(options.top_k);
  params_.renormalize = options.renormalize;
  params_.num_groups = static_cast<int>(options.num_groups);
  params_.topk_groups = static_cast<int>(options.topk_groups);
  params_.scaling_factor = options.scaling_factor;
  params_.topk_before_softmax = options.topk_before_softmax;
  ops::check_router_params(params_, options.num_experts, "router block");
  pinned_params_ = params_;
  pinned_params_.num_groups = 1;
  pinned_params_.topk_groups = 1;
  w_ = store.weight(prefix + "router");
  g_ = store.grad(prefix + "router");
  writer_ = GradientWriter(store, prefix + "router");
  if (options.bias) w_bias_ = store.weight(prefix + "router_bias"), g_bias_ = store.grad(prefix + "router_bias");
}

RoutingMetadata Router::forward(RouterRecord& r, const Tensor& x, const Tensor& pinned) const {
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0);
  r.x = x;
  RoutingMetadata m;
  const DType route_dtype = statistics_dtype(x.dtype());
  m.logits = Tensor::empty({T, options_.num_experts}, route_dtype, x.device());
  m.probs = Tensor::empty({T, options_.num_experts}, route_dtype, x.device());
  m.topk_index = Tensor::empty({T, params_.top_k}, DType::I32, x.device());
  m.topk_weight = Tensor::empty({T, params_.top_k}, route_dtype, x.device());
  ops::linear_forward(s, m.logits, x, w_);
  if (w_bias_.defined()) ops::bias_add(s, m.logits, w_bias_);
  r.pinned = pinned.defined();
  if (pinned.defined()) {
    // The selection the router makes on the pinned logits (their probabilities and weights are not kept), then this
    // router's weights for it.
    Tensor pinned_probs = Tensor::empty(m.probs.shape(), route_dtype, x.device());
    Tensor pinned_weight = Tensor::empty(m.topk_weight.shape(), route_dtype, x.device());
    ops::router_forward(s, pinned_probs, m.topk_index, pinned_weight, pinned, params_);
    ops::router_forward_given(s, m.probs, m.topk_index, m.topk_weight, m.logits, pinned_params_);
  } else {
    ops::router_forward(s, m.probs, m.topk_index, m.topk_weight, m.logits, params_);
  }
  m.plan = ops::make_routing_plan(s, m.topk_index, options_.num_experts);
  return m;
}

Tensor Router::backward_input(RouterRecord& r, const RoutingMetadata& m, const Tensor& d_topk_weight,
                              const Tensor& d_probs, const Tensor& d_logits_extra) const {
  Stream& s = default_stream(r.x.device());
  r.d_logits = Tensor::empty(m.logits.shape(), m.logits.dtype(), m.logits.device());
  ops::router_backward(s, r.d_logits, d_topk_weight, d_probs, m.probs, m.topk_index, m.topk_weight,
                       r.pinned ? pinned_params_ : params_);
  if (d_logits_extra.defined()) ops::accumulate(s, r.d_logits, d_logits_extra);
  if (g_bias_.defined()) ops::bias_backward(s, g_bias_, r.d_logits);  // from the f32 gradient, before any rounding
  if (r.d_logits.dtype() != r.x.dtype()) {                            // the GEMMs take operands of one dtype
    Tensor rounded = Tensor::empty(r.d_logits.shape(), r.x.dtype(), r.x.device());
    ops::cast(s, rounded, r.d_logits);
    r.d_logits = rounded;
  }
  Tensor dx = Tensor::empty(r.x.shape(), r.x.dtype(), r.x.device());
  ops::linear_backward_input(s, dx, r.d_logits, w_);
  return dx;
}

void Router::backward_weight(RouterRecord& r) const {
  ops::linear_backward_weight(default_stream(r.x.device()), g_, r.d_logits, r.x, writer_.next());
  r = RouterRecord{};
}

}  // namespace moetrain::model
