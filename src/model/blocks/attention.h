// defines: GqaAttention, grouped-query self-attention as a token mixer, driven by AttentionOptions: q/k/v
// projections, optional per-head RMSNorm of q and k, rotary embedding on the first rotary_dim dims, causal
// attention within packed documents, output projection. The options leave room for what the other families need
// (q/k/v and output biases, a sigmoid output gate, attention sinks, a sliding window); options this build does not
// run yet are refused by name when the block is built. It knows no HF names: the family maps its parameters.
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
  bool qk_norm = false;  // RMSNorm over each head's dims of q and k, before rope
  float norm_eps = 1e-6f;
  ops::RopeParams rope;  // on the first rope.rotary_dim dims of each head (0: no rope); default or YaRN frequencies
  double softmax_scale = 0.0;  // 0: 1 / sqrt(head_dim)
  // Not run yet (refused when set): biases on q/k/v and o, q_proj emitting a sigmoid output gate (Qwen3.5), a
  // learned sink logit per head (GPT-OSS), attention to the last sliding_window keys only (0: the whole document).
  bool qkv_bias = false;
  bool output_bias = false;
  bool output_gate = false;
  bool sinks = false;
  int64_t sliding_window = 0;
};

class GqaAttention final : public TokenMixer {
 public:
  // Parameters "<prefix>{q_proj,k_proj,v_proj,o_proj}" ([rows, H] matrices) and, with qk_norm,
  // "<prefix>{q_norm,k_norm}" ([head_dim]); role Dense / Norm, in decoder layer `layer`. No HF pieces.
  static std::vector<ParamSpec> param_specs(const AttentionOptions& options, const std::string& prefix, int64_t layer);

  GqaAttention(const AttentionOptions& options, ParameterStore& store, const std::string& prefix);

  std::unique_ptr<MixerRecord> new_record() const override;
  Tensor forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const override;
  Tensor backward_input(MixerRecord& record, const Tensor& d_out) const override;
  void backward_weight(MixerRecord& record) const override;

 private:
  ops::AttentionParams attention_for(const MicroBatch& batch) const;

  AttentionOptions options_;
  ops::RmsNormParams qk_norm_;
  ops::RopeParams rope_;
  ops::AttentionParams attention_;
  Tensor w_q_, w_k_, w_v_, w_o_, w_q_norm_, w_k_norm_;
  Tensor g_q_, g_k_, g_v_, g_o_, g_q_norm_, g_k_norm_;
};

}  // namespace moetrain::model
