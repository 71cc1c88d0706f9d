// defines: the grouped-query self-attention block of Qwen3: q/k/v projections, per-head RMSNorm of
// q and k, rotary embedding, causal attention within packed documents, output projection. Its
// forward saves what backward needs in AttentionRecord; backward is split into input and weight
// gradients so weight work can be deferred (DESIGN.md section 4).
#pragma once

#include <string>

#include "core/tensor.h"
#include "io/model_config.h"
#include "model/batch.h"
#include "model/parameter_store.h"
#include "ops/attention.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace moetrain::model {

struct AttentionRecord {
  Tensor x;               // [T, H] block input (already normed)
  Tensor q, k, v;         // projections before the q/k norm: [T, nh, hd], [T, nkv, hd], [T, nkv, hd]
  Tensor rstd_q, rstd_k;  // [T * nh], [T * nkv]
  Tensor q_rot, k_rot;    // after norm and rope: what attention saw
  Tensor attn, lse;       // attention output [T, nh, hd] and its log-sum-exp [T, nh]
  const MicroBatch* batch = nullptr;
  // Kept by backward_input for backward_weight.
  Tensor d_out, d_q_normed, d_k_normed, d_q, d_k, d_v;
};

class AttentionBlock {
 public:
  // `prefix` is the layer's internal parameter prefix, e.g. "layers.3.".
  AttentionBlock(const io::ModelConfig& config, ParameterStore& store, const std::string& prefix);

  static void add_param_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs);

  Tensor forward(AttentionRecord& record, const Tensor& x, const MicroBatch& batch) const;
  Tensor backward_input(AttentionRecord& record, const Tensor& d_out) const;
  void backward_weight(AttentionRecord& record) const;

 private:
  ops::AttentionParams attention_for(const MicroBatch& batch) const;

  const io::ModelConfig& config_;
  int64_t heads_, kv_heads_, head_dim_;
  ops::RmsNormParams qk_norm_;
  ops::RopeParams rope_;
  ops::AttentionParams attention_;
  Tensor w_q_, w_k_, w_v_, w_o_, w_q_norm_, w_k_norm_;
  Tensor g_q_, g_k_, g_v_, g_o_, g_q_norm_, g_k_norm_;
};

}  // namespace moetrain::model
