// defines: the SwiGLU MLP, as one dense MLP (Qwen3, dense layers of Qwen3-MoE) or as a bank of
// experts run as grouped GEMMs over expert-ordered rows (stage 3 of an MoE layer). gate and up are
// fused into one [2I, H] weight per MLP (gate rows first), down is [H, I].
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/model_config.h"
#include "model/parameter_store.h"

namespace moetrain::model {

struct MlpRecord {
  Tensor x;              // [R, H] input rows
  Tensor group_offsets;  // i32 [E + 1] for experts; undefined for a dense MLP
  Tensor gate_up;        // [R, 2I]
  Tensor act;            // [R, I] silu(gate) * up
  // Kept by backward_input for backward_weight.
  Tensor d_y, d_gate_up;
};

class GatedMlp {
 public:
  // Dense: "<prefix>mlp.{gate_up,down}"; experts: "<prefix>experts.{gate_up,down}".
  GatedMlp(ParameterStore& store, const std::string& prefix, bool experts);

  static void add_dense_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs);
  static void add_expert_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs);

  // group_offsets must be defined exactly when this is an expert bank.
  Tensor forward(MlpRecord& record, const Tensor& x, const Tensor& group_offsets) const;
  Tensor backward_input(MlpRecord& record, const Tensor& d_y) const;
  void backward_weight(MlpRecord& record) const;

 private:
  bool experts_;
  Tensor w_gate_up_, w_down_, g_gate_up_, g_down_;
};

}  // namespace moetrain::model
