// defines: the gated MLP's parameters, forward and split backward (dense or an expert bank).
#include "model/blocks/gated_mlp.h"

#include <algorithm>
#include <cstddef>

#include "core/error.h"
#include "ops/activation.h"
#include "ops/bias.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/row_gather.h"

namespace moetrain::model {

std::vector<ParamSpec> GatedMlp::param_specs(const GatedMlpOptions& o, const std::string& prefix, int64_t layer) {
  const int64_t h = o.hidden_size, i = o.intermediate_size;
  Shape gate_up{2 * i, h}, down{h, i};
  if (o.num_experts > 0) {
    gate_up.insert(gate_up.begin(), o.num_experts);
    down.insert(down.begin(), o.num_experts);
  }
  std::vector<ParamSpec> specs(o.bias ? 4 : 2);
  specs[0].name = prefix + "gate_up", specs[0].shape = gate_up;
  specs[1].name = prefix + "down", specs[1].shape = down;
  if (o.bias) {
    // The bias of each output row: gate_up [.., 2I, H] -> [.., 2I], down [.., H, I] -> [.., H].
    specs[2].name = prefix + "gate_up_bias", specs[2].shape = Shape(gate_up.begin(), gate_up.end() - 1);
    specs[3].name = prefix + "down_bias", specs[3].shape = Shape(down.begin(), down.end() - 1);
    specs[2].init = specs[3].init = ParamInit::Zeros;
    specs[2].f32_compute = specs[3].f32_compute = true;  // added in f32, as transformers' GPT-OSS experts do
  }
  for (ParamSpec& spec : specs) {
    spec.role = o.role;
    spec.layer = layer;
  }
  return specs;
}

GatedMlp::GatedMlp(const GatedMlpOptions& options, ParameterStore& store, const std::string& prefix)
    : options_(options) {
  clamped_.alpha = options.swiglu_alpha;
  clamped_.limit = options.swiglu_limit;
  if (options.activation == GatedActivation::ClampedSwiGlu) ops::check_clamped_swiglu_params(clamped_, "gated MLP");
  MT_CHECK((options.num_experts > 0) == (options.role == ParamRole::ExpertBank),
           "gated MLP: {} experts with role '{}': an expert bank (E > 0) has the role 'expert bank', a dense MLP not",
           options.num_experts, param_role_name(options.role));
  w_gate_up_ = store.weight(prefix + "gate_up"), g_gate_up_ = store.grad(prefix + "gate_up");
  w_down_ = store.weight(prefix + "down"), g_down_ = store.grad(prefix + "down");
  if (options.bias) {
    w_gate_up_bias_ = store.weight(prefix + "gate_up_bias"), g_gate_up_bias_ = store.grad(prefix + "gate_up_bias");
    w_down_bias_ = store.weight(prefix + "down_bias"), g_down_bias_ = store.grad(prefix + "down_bias");
  }
  // The weight GEMMs overwrite the gradients on their first write of a step (an expert bank's are the largest
  // gradients of an MoE model): nothing zeroes them, and the first micro-batch's GEMMs never read them.
  gate_up_writer_ = GradientWriter(store, prefix + "gate_up");
  down_writer_ = GradientWriter(store, prefix + "down");
}

void GatedMlp::activation_forward(const Tensor& act, const Tensor& gate_up) const {
  Stream& s = default_stream(gate_up.device());
  if (options_.activation == GatedActivation::ClampedSwiGlu) {
    ops::clamped_swiglu_forward(s, act, gate_up, clamped_);
  } else {
    ops::swiglu_forward(s, act, gate_up);
  }
}

void GatedMlp::activation_backward(const Tensor& d_gate_up, const Tensor& d_act, const Tensor& gate_up) const {
  Stream& s = default_stream(gate_up.device());
  if (options_.activation == GatedActivation::ClampedSwiGlu) {
    ops::clamped_swiglu_backward(s, d_gate_up, d_act, gate_up, clamped_);
  } else {
    ops::swiglu_backward(s, d_gate_up, d_act, gate_up);
  }
}

void GatedMlp::add_bias(const Tensor& y, const Tensor& bias, const Tensor& group_offsets) const {
  if (!bias.defined()) return;
  Stream& s = default_stream(y.device());
  if (is_expert_bank()) {
    ops::grouped_bias_add(s, y, bias, group_offsets);
  } else {
    ops::bias_add(s, y, bias);
  }
}

void GatedMlp::bias_grad(const Tensor& g_bias, const Tensor& dy, const Tensor& group_offsets) const {
  if (!g_bias.defined()) return;
  Stream& s = default_stream(dy.device());
  if (is_expert_bank()) {
    ops::grouped_bias_backward(s, g_bias, dy, group_offsets);
  } else {
    ops::bias_backward(s, g_bias, dy);
  }
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
  } else {
    ops::linear_forward(s, r.gate_up, x, w_gate_up_);
  }
  add_bias(r.gate_up, w_gate_up_bias_, group_offsets);
  activation_forward(r.act, r.gate_up);
  if (is_expert_bank()) {
    ops::grouped_linear_forward(s, y, r.act, w_down_, group_offsets);
  } else {
    ops::linear_forward(s, y, r.act, w_down_);
  }
  add_bias(y, w_down_bias_, group_offsets);
  if (recompute_activation_) r.act = Tensor();
  return y;
}

Tensor GatedMlp::backward_input(MlpRecord& r, const Tensor& d_y) const {
  Stream& s = default_stream(d_y.device());
  r.d_y = d_y;
  const int64_t width = w_down_.size(-1);
  Tensor d_act = Tensor::empty({r.gate_up.size(0), width}, d_y.dtype(), d_y.device());
  r.d_gate_up = Tensor::empty(r.gate_up.shape(), d_y.dtype(), d_y.device());
  Tensor dx = Tensor::empty(r.x.shape(), d_y.dtype(), d_y.device());
  if (is_expert_bank()) {
    ops::grouped_linear_backward_input(s, d_act, d_y, w_down_, r.group_offsets);
  } else {
    ops::linear_backward_input(s, d_act, d_y, w_down_);
  }
  activation_backward(r.d_gate_up, d_act, r.gate_up);
  d_act = Tensor();        // its memory back before act is made again
  if (!r.act.defined()) {  // recomputed for the down projection's weight gradient
    r.act = Tensor::empty({r.gate_up.size(0), width}, r.gate_up.dtype(), r.gate_up.device());
    activation_forward(r.act, r.gate_up);
  }
  if (is_expert_bank()) {
    ops::grouped_linear_backward_input(s, dx, r.d_gate_up, w_gate_up_, r.group_offsets);
  } else {
    ops::linear_backward_input(s, dx, r.d_gate_up, w_gate_up_);
  }
  return dx;
}

void GatedMlp::backward_weight(MlpRecord& r) const {
  Stream& s = default_stream(r.x.device());
  if (is_expert_bank()) {
    ops::grouped_linear_backward_weight(s, g_down_, r.d_y, r.act, r.group_offsets, down_writer_.next());
    ops::grouped_linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x, r.group_offsets, gate_up_writer_.next());
  } else {
    ops::linear_backward_weight(s, g_down_, r.d_y, r.act, down_writer_.next());
    ops::linear_backward_weight(s, g_gate_up_, r.d_gate_up, r.x, gate_up_writer_.next());
  }
  bias_grad(g_down_bias_, r.d_y, r.group_offsets);
  bias_grad(g_gate_up_bias_, r.d_gate_up, r.group_offsets);
  r = MlpRecord{};
}

void GatedMlp::keep_for_weight_work(MlpRecord& r) { r.gate_up = Tensor(); }

namespace {

// The records' rows `field` concatenated group by group (their group offsets `offsets`): copied from the records that
// hold them, or made from the sources `source` of records that hold those instead (all of a batch the one way).
// `like` gives the rows' dtype and device.
Tensor concat_records(Stream& s, const std::vector<MlpRecord*>& records, Tensor MlpRecord::*field,
                      ops::PermutedRows MlpRecord::*source, const std::vector<Tensor>& offsets, int64_t total_rows,
                      const Tensor& like) {
  const auto has_source = [&](const MlpRecord* r) { return source != nullptr && (r->*source).tokens.defined(); };
  const bool from_sources = has_source(records.front());
  for (const MlpRecord* r : records) {
    MT_CHECK(has_source(r) == from_sources && (r->*field).defined() != from_sources,
             "gated MLP: the held records of one weight gradient must all hold their rows, or all their rows' sources");
  }
  if (from_sources) {
    std::vector<ops::PermutedRows> sources;
    for (const MlpRecord* r : records) sources.push_back(r->*source);
    const int64_t width = sources.front().tokens.size(1);
    Tensor out = Tensor::empty({total_rows, width}, like.dtype(), like.device());
    ops::concat_permuted_rows(s, out, sources);
    return out;
  }
  std::vector<Tensor> parts;
  for (const MlpRecord* r : records) parts.push_back(r->*field);
  const Tensor& first = parts.front();
  Tensor out = Tensor::empty({total_rows, first.size(1)}, first.dtype(), first.device());
  ops::concat_group_rows(s, out, parts, offsets);
  return out;
}

}  // namespace

void GatedMlp::backward_weight_together(const std::vector<MlpRecord*>& records) const {
  if (!is_expert_bank() || (records.size() == 1 && records.front()->x.defined())) {
    for (MlpRecord* r : records) backward_weight(*r);
    return;
  }
  // At most kMaxGroupParts records a grouped GEMM; more accumulate onto the first batch's gradient.
  for (size_t begin = 0; begin < records.size(); begin += ops::kMaxGroupParts) {
    const size_t end = std::min(records.size(), begin + static_cast<size_t>(ops::kMaxGroupParts));
    const std::vector<MlpRecord*> batch(records.begin() + static_cast<std::ptrdiff_t>(begin),
                                        records.begin() + static_cast<std::ptrdiff_t>(end));
    std::vector<Tensor> offsets;
    int64_t rows = 0;
    for (const MlpRecord* r : batch) {
      offsets.push_back(r->group_offsets);
      rows += r->d_gate_up.size(0);
    }
    const Tensor like = batch.front()->d_gate_up;  // the rows' dtype and device
    Stream& s = default_stream(like.device());
    Tensor group_offsets = Tensor::empty({offsets.front().numel()}, DType::I32, like.device());
    ops::concat_group_offsets(s, group_offsets, offsets);
    // The down projection's operands first, then the gate_up projection's: two [rows, .] pairs alive at a time.
    {
      const Tensor d_y = concat_records(s, batch, &MlpRecord::d_y, &MlpRecord::d_y_source, offsets, rows, like);
      const Tensor act = concat_records(s, batch, &MlpRecord::act, nullptr, offsets, rows, like);
      for (MlpRecord* r : batch) {
        r->d_y = r->act = Tensor();
        r->d_y_source = ops::PermutedRows{};
      }
      ops::grouped_linear_backward_weight(s, g_down_, d_y, act, group_offsets, down_writer_.next());
      bias_grad(g_down_bias_, d_y, group_offsets);
    }
    const Tensor d_gate_up = concat_records(s, batch, &MlpRecord::d_gate_up, nullptr, offsets, rows, like);
    const Tensor x = concat_records(s, batch, &MlpRecord::x, &MlpRecord::x_source, offsets, rows, like);
    for (MlpRecord* r : batch) *r = MlpRecord{};
    ops::grouped_linear_backward_weight(s, g_gate_up_, d_gate_up, x, group_offsets, gate_up_writer_.next());
    bias_grad(g_gate_up_bias_, d_gate_up, group_offsets);
  }
}

}  // namespace moetrain::model
