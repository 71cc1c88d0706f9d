// defines: SharedExpert, a gated MLP that every token of an MoE layer goes through besides its routed experts,
// added in stage 5 (DeepSeek-V2's shared experts), optionally scaled per token by a sigmoid gate, sigmoid(x . g) with
// g [1, H] (Qwen3.5's shared_expert_gate). It computes on the rank's own tokens, so it can run while the combine
// all-to-all is on the wire.
#pragma once

#include <string>
#include <vector>

#include "model/blocks/gated_mlp.h"

namespace moetrain::model {

struct SharedExpertOptions {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // all shared experts together (DeepSeek: n_shared_experts x moe_intermediate_size)
  bool sigmoid_gate = false;      // out = sigmoid(x . g) * mlp(x), g [1, H] (Qwen3.5)
};

struct SharedExpertRecord {
  MlpRecord mlp;
  // With the sigmoid gate: the input, the gate's logit [T, 1] and the MLP's output before the gate; kept by
  // backward_input: the logit's gradient.
  Tensor x, logit, y, d_logit;
};

class SharedExpert {
 public:
  // "<prefix>gate_up", "<prefix>down", and with the sigmoid gate "<prefix>sigmoid_gate" [1, H]; role SharedExpert.
  static std::vector<ParamSpec> param_specs(const SharedExpertOptions& options, const std::string& prefix,
                                            int64_t layer);

  SharedExpert(const SharedExpertOptions& options, ParameterStore& store, const std::string& prefix);

  // x [T, H] (the layer's normed tokens) -> [T, H].
  Tensor forward(SharedExpertRecord& record, const Tensor& x) const;
  Tensor backward_input(SharedExpertRecord& record, const Tensor& d_out) const;
  void backward_weight(SharedExpertRecord& record) const;

  static GatedMlpOptions mlp_options(const SharedExpertOptions& options);
  void set_recompute_activation(bool on) { mlp_.set_recompute_activation(on); }

 private:
  SharedExpertOptions options_;
  GatedMlp mlp_;
  Tensor w_gate_, g_gate_;      // the sigmoid gate's [1, H], when on
  GradientWriter gate_writer_;  // its weight gradient's first write of a step overwrites
};

}  // namespace moetrain::model
