// defines: GqaAttention, grouped-query self-attention as a token mixer, driven by AttentionOptions: q/k/v
// projections (optionally biased), optional per-head RMSNorm of q and k, rotary embedding on the first rotary_dim
// dims, causal attention within packed documents (optionally over a sliding window, optionally with a learned sink
// logit per head in every softmax denominator), optionally a sigmoid output gate (Qwen3.5: q_proj emits each head's
// query and then its gate, and the attention output is multiplied by sigmoid(gate) before the output projection),
// output projection (optionally biased). It knows no HF names: the family maps its parameters.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/batch.h"
#include "model/blocks/token_mixer.h"
#include "model/parameter_store.h"
#include "ops/attention.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace moetrain::model {

struct AttentionOptions {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool qk_norm = false;                // RMSNorm over each head's dims of q and k, before rope
  bool qk_norm_zero_centered = false;  // the q/k norms scale by 1 + w (Qwen3.5), their weights starting at 0
  float norm_eps = 1e-6f;
  ops::RopeParams rope;  // on the first rope.rotary_dim dims of each head (0: no rope); default or YaRN frequencies
  double softmax_scale = 0.0;  // 0: 1 / sqrt(head_dim)
  bool qkv_bias = false;       // biases on the q, k and v projections (GPT-OSS)
  bool output_bias = false;    // a bias on the output projection (GPT-OSS)
  // A learned logit per query head that joins every softmax denominator with a zero value (GPT-OSS's sinks).
  bool sinks = false;
  int64_t sliding_window = 0;  // a query sees its last sliding_window keys, itself included (0: the whole document)
  // q_proj [num_heads * 2 * head_dim, H] emits per head its query (head_dim rows) then its gate (head_dim rows), as
  // transformers' Qwen3_5Attention chunks q_proj's output viewed [.., heads, 2 * head_dim]; the attention output is
  // multiplied by sigmoid(gate) before o_proj (Qwen3.5).
  bool output_gate = false;
};

class GqaAttention final : public TokenMixer {
 public:
  // Parameters "<prefix>{q_proj,k_proj,v_proj,o_proj}" ([rows, H] matrices; q_proj twice as many rows with the output
  // gate, and so its bias); with qk_norm "<prefix>{q_norm,k_norm}"
  // ([head_dim], role Norm); with the biases "<prefix>{q_bias,k_bias,v_bias}" and "<prefix>o_bias" ([rows]); with
  // sinks "<prefix>sinks" ([num_heads]). In decoder layer `layer`; no HF pieces.
  static std::vector<ParamSpec> param_specs(const AttentionOptions& options, const std::string& prefix, int64_t layer);

  GqaAttention(const AttentionOptions& options, ParameterStore& store, const std::string& prefix);

  std::unique_ptr<MixerRecord> new_record() const override;
  Tensor forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const override;
  Tensor backward_input(MixerRecord& record, const Tensor& d_out) const override;
  void backward_weight(MixerRecord& record) const override;
  // Generation: the prefill attends as training does and keeps every prompt's keys and values; a step appends each
  // sequence's new token to them and attends over its cached prefix (ops::attention_decode_forward, the same
  // per-query instructions as the training forward).
  std::string decoding_support() const override { return ""; }

 private:
  ops::AttentionParams attention_for(const MicroBatch& batch) const;

  AttentionOptions options_;
  ops::RmsNormParams qk_norm_;
  ops::RopeParams rope_;
  ops::AttentionParams attention_;
  Tensor w_q_, w_k_, w_v_, w_o_, w_q_norm_, w_k_norm_, w_q_bias_, w_k_bias_, w_v_bias_, w_o_bias_, w_sinks_;
  Tensor g_q_, g_k_, g_v_, g_o_, g_q_norm_, g_k_norm_, g_q_bias_, g_k_bias_, g_v_bias_, g_o_bias_, g_sinks_;
  GradientWriter q_writer_, k_writer_, v_writer_, o_writer_;  // the projections' weight gradients: first writes
};

}  // namespace moetrain::model
