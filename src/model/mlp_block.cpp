// defines: the gated MLP's parameters (with the HF gate/up/down pieces) and its forward/backward.
#include "model/mlp_block.h"

#include <fmt/format.h>

#include "ops/activation.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"

namespace moetrain::model {

void GatedMlp::add_dense_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs) {
  const std::string hf = fmt::format("model.layers.{}.mlp.", layer);
  const std::string in = fmt::format("layers.{}.mlp.", layer);
  const int64_t h = config.hidden_size, i = config.intermediate_size;
  specs.push_back(
      {in + "gate_up", {2 * i, h}, {{hf + "gate_proj.weight", {i, h}, 0}, {hf + "up_proj.weight", {i, h}, i * h}}});
  specs.push_back({in + "down", {h, i}, {{hf + "down_proj.weight", {h, i}, 0}}});
}

void GatedMlp::add_expert_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs) {
  const std::string in = fmt::format("layers.{}.experts.", layer);
  const int64_t h = config.hidden_size, i = config.moe_intermediate_size, e_count = config.num_experts;
  const std::string fused = fmt::format("model.layers.{}.mlp.experts.", layer);
  ParamSpec gate_up{in + "gate_up", {e_count, 2 * i, h}, {}, fused + "gate_up_proj"};
  ParamSpec down{in + "down", {e_count, h, i}, {}, fused + "down_proj"};
  for (int64_t e = 0; e < e_count; ++e) {
    const std::string hf = fmt::format("model.layers.{}.mlp.experts.{}.", layer, e);
    gate_up.pieces.push_back({hf + "gate_proj.weight", {i, h}, e * 2 * i * h});
    gate_up.pieces.push_back({hf + "up_proj.weight", {i, h}, e * 2 * i * h + i * h});
    down.pieces.push_back({hf + "down_proj.weight", {h, i}, e * h * i});
  }
  specs.push_back(std::move(gate_up));
  specs.push_back(std::move(down));
}

GatedMlp::GatedMlp(ParameterStore& store, const std::string& prefix, bool experts) : experts_(experts) {
  const std::string p = prefix + (experts ? "experts." : "mlp.");
  w_gate_up_ = store.weight(p + "gate_up"), g_gate_up_ = store.grad(p + "gate_up");
  w_down_ = store.weight(p + "down"), g_down_ = store.grad(p + "down");
}

Tensor GatedMlp::forward(MlpRecord& r, const Tensor& x, const Tensor& group_offsets) const {
  MT_CHECK(group_offsets.defined() == experts_, "gated MLP: group offsets are {} for {} MLP",
           group_offsets.defined() ? "given" : "missing", experts_ ? "an expert" : "a dense");
  Stream& s = default_stream(x.device());
  const int64_t rows = x.size(0);
  const int64_t width = w_down_.size(-1);
  r.x = x;
  r.group_offsets = group_offsets;
  r.gate_up = Tensor::empty({rows, 2 * width}, x.dtype(), x.device());
  r.act = Tensor::empty({rows, width}, x.dtype(), x.device());
  Tensor y = Tensor::empty({rows, w_down_.size(-2)}, x.dtype(), x.device());
  if (experts_) {
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
  if (experts_) {
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
  if (experts_) {
    ops::grouped_linear_backward_weight(s, g_down_, r.d_y, r.act, r.group_offsets);
    ops::grouped_linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x, r.group_offsets);
  } else {
    ops::linear_backward_weight(s, g_down_, r.d_y, r.act);
    ops::linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x);
  }
  r = MlpRecord{};
}

}  // namespace moetrain::model
