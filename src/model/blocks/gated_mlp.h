// defines: GatedMlp, the gated MLP y = down(act(gate(x), up(x))), as one dense MLP (a dense layer's stage 3, a
// shared expert) or as a bank of experts run as grouped GEMMs over expert-ordered rows (an MoE layer's stage 3).
// gate and up are fused into one [2I, H] weight per MLP (gate rows first), down is [H, I]; an expert bank stacks
// them into [E, 2I, H] and [E, H, I]; optional biases [2I] and [H] ([E, 2I], [E, H]) follow each projection. The
// activation is SwiGLU or GPT-OSS's clamped SwiGLU. It knows no HF names: the family maps its parameters.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/parameter_store.h"
#include "ops/activation.h"
#include "ops/grouped_gemm.h"
#include "ops/permute.h"

namespace moetrain::model {

enum class GatedActivation : uint8_t {
  SwiGlu,         // silu(gate) * up
  ClampedSwiGlu,  // GPT-OSS: (up + 1) * gate * sigmoid(alpha * gate), gate clamped <= limit, up to [-limit, limit]
};

struct GatedMlpOptions {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_experts = 0;  // 0: one dense MLP; E > 0: an expert bank of E MLPs
  GatedActivation activation = GatedActivation::SwiGlu;
  float swiglu_alpha = 1.702f;  // ClampedSwiGlu's alpha and limit
  float swiglu_limit = 7.0f;
  bool bias = false;                  // biases on gate_up and down (GPT-OSS)
  ParamRole role = ParamRole::Dense;  // Dense, SharedExpert, or ExpertBank for a bank
};

struct MlpRecord {
  Tensor x;              // [R, H] input rows
  Tensor group_offsets;  // i32 [E + 1] for experts; undefined for a dense MLP
  Tensor gate_up;        // [R, 2I]
  Tensor act;            // [R, I] act(gate) * up (dropped after the forward when recomputed)
  // Kept by backward_input for backward_weight.
  Tensor d_y, d_gate_up;
  // A record held for backward_weight_together may hold these instead of x and d_y: its layer made the rows by
  // permuting its own tokens (no expert exchange), so each row is made again from the token side (a copy of the
  // normed token; the routing weight times the output's gradient), bitwise what x and d_y held, in a fraction of
  // their memory (the tokens once instead of each of their K copies).
  ops::PermutedRows x_source, d_y_source;
};

class GatedMlp {
 public:
  // "<prefix>gate_up" and "<prefix>down" of decoder layer `layer`, with the options' role, and with biases
  // "<prefix>gate_up_bias" and "<prefix>down_bias" (zeros at init). No HF pieces.
  static std::vector<ParamSpec> param_specs(const GatedMlpOptions& options, const std::string& prefix, int64_t layer);

  GatedMlp(const GatedMlpOptions& options, ParameterStore& store, const std::string& prefix);

  bool is_expert_bank() const { return options_.num_experts > 0; }
  // group_offsets must be defined exactly when this is an expert bank.
  Tensor forward(MlpRecord& record, const Tensor& x, const Tensor& group_offsets) const;
  // Recomputing the activation: the forward drops act [R, I] once the down projection has read it, and
  // backward_input recomputes it from gate_up (the same kernel on the same input: the same bits) for the down
  // projection's weight gradient. The records of the micro-batches in flight then hold no activation.
  void set_recompute_activation(bool on) { recompute_activation_ = on; }
  Tensor backward_input(MlpRecord& record, const Tensor& d_y) const;
  void backward_weight(MlpRecord& record) const;
  // Keeps a record whose backward_input ran for backward_weight_together: drops what the weight work does not read.
  static void keep_for_weight_work(MlpRecord& record);
  // The weight gradients of several records at once; an expert bank computes them in one grouped GEMM per weight over
  // all the records' rows (ops::concat_group_rows: each expert's rows of every record in record order, or
  // ops::concat_permuted_rows from records that hold their rows' sources), so each expert's gradient is written once
  // (overwritten on the step's first write) instead of read and written per record.
  // The sum of backward_weight over the records, in another f32 summation order. A dense MLP runs backward_weight on
  // each. Frees the records.
  void backward_weight_together(const std::vector<MlpRecord*>& records) const;

 private:
  void activation_forward(const Tensor& act, const Tensor& gate_up) const;
  void activation_backward(const Tensor& d_gate_up, const Tensor& d_act, const Tensor& gate_up) const;
  // y += the bias of its projection (per group of rows for an expert bank); nothing without biases.
  void add_bias(const Tensor& y, const Tensor& bias, const Tensor& group_offsets) const;
  void bias_grad(const Tensor& g_bias, const Tensor& dy, const Tensor& group_offsets) const;

  GatedMlpOptions options_;
  bool recompute_activation_ = false;
  ops::ClampedSwigluParams clamped_;
  Tensor w_gate_up_, w_down_, g_gate_up_, g_down_;
  Tensor w_gate_up_bias_, w_down_bias_, g_gate_up_bias_, g_down_bias_;
  // The weight gradients' writes: each overwrites on the step's first (ParameterStore::overwrite_on_first_write).
  GradientWriter gate_up_writer_, down_writer_;
};

}  // namespace moetrain::model
