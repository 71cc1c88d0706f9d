// defines: the gated MLP's parameters, forward and split backward (dense or an expert bank).
#include "model/blocks/gated_mlp.h"

#include "core/error.h"
#include "ops/activation.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"

namespace moetrain::model {

std::vector<ParamSpec> GatedMlp::param_specs(const GatedMlpOptions& o, const std::string& prefix, int64_t layer) {
  const int64_t h = o.hidden_size, i = o.intermediate_size;
  Shape gate_up{2 * i, h}, down{h, i};
  if (o.num_experts > 0) {
    gate_up.insert(gate_up.begin(), o.num_experts);
    down.insert(down.begin(), o.num_experts);
  }
  std::vector<ParamSpec> specs(2);
  specs[0].name = prefix + "gate_up", specs[0].shape = gate_up;
  specs[1].name = prefix + "down", specs[1].shape = down;
  for (ParamSpec& spec : specs) {
    spec.role = o.role;
    spec.layer = layer;
  }
  return specs;
}

GatedMlp::GatedMlp(const GatedMlpOptions& options, ParameterStore& store, const std::string& prefix)
    : options_(options) {
  MT_CHECK(options.activation == GatedActivation::SwiGlu,
           "gated MLP: the clamped SwiGLU activation is not supported yet");
  MT_CHECK(!options.bias, "gated MLP: biases on gate_up and down are not supported yet");
  MT_CHECK((options.num_experts > 0) == (options.role == ParamRole::ExpertBank),
           "gated MLP: {} experts with role '{}': an expert bank (E > 0) has the role 'expert bank', a dense MLP not",
           options.num_experts, param_role_name(options.role));
  w_gate_up_ = store.weight(prefix + "gate_up"), g_gate_up_ = store.grad(prefix + "gate_up");
  w_down_ = store.weight(prefix + "down"), g_down_ = store.grad(prefix + "down");
}

Tensor GatedMlp::forward(MlpRecord& r, const Tensor& x, const Tensor& group_offsets) const {
  MT_CHECK(group_offsets.defined() == is_expert_bank(), "gated MLP: group offsets are {} for {} MLP",
           group_offsets.defined() ? "given" : "missing", is_expert_bank() ? "an expert" : "a dense");
  Stream& s = default_stream(x.device());
  const int64_t rows = x.size(0);
  const int64_t width = w_down_.size(-1);
  r.x = x;
  r.group_offsets = group_offsets;
  r.gate_up = Tensor::empty({rows, 2 * width}, x.dtype(), x.device());
  r.act = Tensor::empty({rows, width}, x.dtype(), x.device());
  Tensor y = Tensor::empty({rows, w_down_.size(-2)}, x.dtype(), x.device());
  if (is_expert_bank()) {
    ops::grouped_linear_forward(s, r.gate_up, x, w_gate_up_, group_offsets);
    ops::swiglu_forward(s, r.act, r.gate_up);
    ops::grouped_linear_forward(s, y, r.act, w_down_, group_offsets);
  } else {
    ops::linear_forward(s, r.gate_up, x, w_gate_up_);
    ops::swiglu_forward(s, r.act, r.gate_up);
    ops::linear_forward(s, y, r.act, w_down_);
  }
  return y;
}

Tensor GatedMlp::backward_input(MlpRecord& r, const Tensor& d_y) const {
  Stream& s = default_stream(d_y.device());
  r.d_y = d_y;
  Tensor d_act = Tensor::empty(r.act.shape(), d_y.dtype(), d_y.device());
  r.d_gate_up = Tensor::empty(r.gate_up.shape(), d_y.dtype(), d_y.device());
  Tensor dx = Tensor::empty(r.x.shape(), d_y.dtype(), d_y.device());
  if (is_expert_bank()) {
    ops::grouped_linear_backward_input(s, d_act, d_y, w_down_, r.group_offsets);
    ops::swiglu_backward(s, r.d_gate_up, d_act, r.gate_up);
    ops::grouped_linear_backward_input(s, dx, r.d_gate_up, w_gate_up_, r.group_offsets);
  } else {
    ops::linear_backward_input(s, d_act, d_y, w_down_);
    ops::swiglu_backward(s, r.d_gate_up, d_act, r.gate_up);
    ops::linear_backward_input(s, dx, r.d_gate_up, w_gate_up_);
  }
  return dx;
}

void GatedMlp::backward_weight(MlpRecord& r) const {
  Stream& s = default_stream(r.x.device());
  if (is_expert_bank()) {
    ops::grouped_linear_backward_weight(s, g_down_, r.d_y, r.act, r.group_offsets);
    ops::grouped_linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x, r.group_offsets);
  } else {
    ops::linear_backward_weight(s, g_down_, r.d_y, r.act);
    ops::linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x);
  }
  r = MlpRecord{};
}

}  // namespace moetrain::model
