// defines: the shared expert's parameters, construction and passes (the dense gated MLP's, then the optional sigmoid
// gate: logit = x g^T [T, 1], out = y * sigmoid(logit)).
#include "model/blocks/shared_expert.h"

#include "core/error.h"
#include "ops/activation.h"
#include "ops/gemm.h"

namespace moetrain::model {

GatedMlpOptions SharedExpert::mlp_options(const SharedExpertOptions& options) {
  GatedMlpOptions mlp;
  mlp.hidden_size = options.hidden_size;
  mlp.intermediate_size = options.intermediate_size;
  mlp.role = ParamRole::SharedExpert;
  return mlp;
}

std::vector<ParamSpec> SharedExpert::param_specs(const SharedExpertOptions& options, const std::string& prefix,
                                                 int64_t layer) {
  std::vector<ParamSpec> specs = GatedMlp::param_specs(mlp_options(options), prefix, layer);
  if (options.sigmoid_gate) {
    ParamSpec gate;
    gate.name = prefix + "sigmoid_gate";
    gate.shape = {1, options.hidden_size};
    gate.role = ParamRole::SharedExpert;
    gate.layer = layer;
    gate.init = ParamInit::Normal;
    specs.push_back(std::move(gate));
  }
  return specs;
}

SharedExpert::SharedExpert(const SharedExpertOptions& options, ParameterStore& store, const std::string& prefix)
    : options_(options), mlp_(mlp_options(options), store, prefix) {
  if (options.sigmoid_gate) {
    w_gate_ = store.weight(prefix + "sigmoid_gate");
    g_gate_ = store.grad(prefix + "sigmoid_gate");
    gate_writer_ = GradientWriter(store, prefix + "sigmoid_gate");
  }
}

Tensor SharedExpert::forward(SharedExpertRecord& r, const Tensor& x) const {
  Tensor y = mlp_.forward(r.mlp, x, Tensor());
  if (!options_.sigmoid_gate) return y;
  Stream& s = default_stream(x.device());
  r.x = x;
  r.y = y;
  r.logit = Tensor::empty({x.size(0), 1}, x.dtype(), x.device());
  ops::linear_forward(s, r.logit, x, w_gate_);
  Tensor out = Tensor::empty(y.shape(), y.dtype(), y.device());
  ops::sigmoid_gate_forward(s, out, y, r.logit);
  return out;
}

Tensor SharedExpert::backward_input(SharedExpertRecord& r, const Tensor& d_out) const {
  if (!options_.sigmoid_gate) return mlp_.backward_input(r.mlp, d_out);
  Stream& s = default_stream(d_out.device());
  Tensor d_y = Tensor::empty(d_out.shape(), d_out.dtype(), d_out.device());
  r.d_logit = Tensor::empty(r.logit.shape(), r.logit.dtype(), r.logit.device());
  ops::sigmoid_gate_backward(s, d_y, r.d_logit, d_out, r.y, r.logit);
  Tensor dx = mlp_.backward_input(r.mlp, d_y);
  ops::linear_backward_input_accumulate(s, dx, r.d_logit, w_gate_);
  return dx;
}

void SharedExpert::backward_weight(SharedExpertRecord& r) const {
  mlp_.backward_weight(r.mlp);
  if (options_.sigmoid_gate) {
    ops::linear_backward_weight(default_stream(r.x.device()), g_gate_, r.d_logit, r.x, gate_writer_.next());
    r.x = r.logit = r.y = r.d_logit = Tensor();
  }
}

}  // namespace moetrain::model
