// defines: SharedExpert, a gated MLP that every token of an MoE layer goes through besides its routed experts,
// added in stage 5 (DeepSeek-V2's shared experts; Qwen3.5's, which is scaled by a sigmoid gate, sigmoid(x w_g), not
// run yet: refused). It computes on the rank's own tokens, so it can run while the combine all-to-all is on the wire.
#pragma once

#include <string>
#include <vector>

#include "model/blocks/gated_mlp.h"

namespace moetrain::model {

struct SharedExpertOptions {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // all shared experts together (DeepSeek: n_shared_experts x moe_intermediate_size)
  bool sigmoid_gate = false;
};

class SharedExpert {
 public:
  // "<prefix>gate_up", "<prefix>down", role SharedExpert.
  static std::vector<ParamSpec> param_specs(const SharedExpertOptions& options, const std::string& prefix,
                                            int64_t layer);

  SharedExpert(const SharedExpertOptions& options, ParameterStore& store, const std::string& prefix);

  // x [T, H] (the layer's normed tokens) -> [T, H].
  Tensor forward(MlpRecord& record, const Tensor& x) const { return mlp_.forward(record, x, Tensor()); }
  Tensor backward_input(MlpRecord& record, const Tensor& d_y) const { return mlp_.backward_input(record, d_y); }
  void backward_weight(MlpRecord& record) const { mlp_.backward_weight(record); }

  static GatedMlpOptions mlp_options(const SharedExpertOptions& options);

 private:
  GatedMlp mlp_;
};

}  // namespace moetrain::model
