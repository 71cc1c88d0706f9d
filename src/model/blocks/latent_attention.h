// defines: LatentAttention, multi-head latent attention (DeepSeek-V2's MLA) as a token mixer, driven by
// LatentAttentionOptions: queries from q_proj, or through a low-rank q_a_proj -> RMSNorm -> q_b_proj; keys and values
// from one compressed latent (kv_a_proj -> RMSNorm -> kv_b_proj, split per head into k_nope and v) plus a decoupled
// rotary key that all heads share; the query/key head dim (nope + rope) may differ from the value head dim. It knows
// no HF names: the family maps its parameters.
//
// The per-head query and key keep transformers' [nope dims | rope dims] order: the query's rope dims rotate in place in
// the projection's output, and each head's key is its k_nope followed by the shared rotated key.
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

struct LatentAttentionOptions {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t q_lora_rank = 0;  // 0: a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  float lora_norm_eps = 1e-6f;  // the q_a and kv_a norms
  ops::RopeParams rope;  // rotary_dim == qk_rope_head_dim, first_rotated_dim 0 (interleaved pairs for DeepSeek-V2)
  double softmax_scale = 0.0;  // 0: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

class LatentAttention final : public TokenMixer {
 public:
  // "<prefix>q_proj" (or "<prefix>{q_a_proj,q_a_norm,q_b_proj}"), "<prefix>{kv_a_proj,kv_a_norm,kv_b_proj,o_proj}" of
  // decoder layer `layer`; roles Dense and Norm. No HF pieces.
  static std::vector<ParamSpec> param_specs(const LatentAttentionOptions& options, const std::string& prefix,
                                            int64_t layer);

  LatentAttention(const LatentAttentionOptions& options, ParameterStore& store, const std::string& prefix);

  std::unique_ptr<MixerRecord> new_record() const override;
  Tensor forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const override;
  Tensor backward_input(MixerRecord& record, const Tensor& d_out) const override;
  void backward_weight(MixerRecord& record) const override;
  // Generation caches each token's per-head keys (nope | rope) and values, as attention takes them (model/blocks/
  // cached_attention.h); the compressed latent cache DeepSeek-V2 serves with is a memory saving not made yet.
  std::string decoding_support() const override { return ""; }

 private:
  ops::AttentionParams attention_for(const MicroBatch& batch) const;

  LatentAttentionOptions options_;
  ops::RmsNormParams lora_norm_;
  ops::RopeParams key_rope_;    // the shared rotary key [T, 1, rope]
  ops::RopeParams query_rope_;  // the queries [T, nh, nope + rope]: the same rotation of each head's last dims
  ops::AttentionParams attention_;
  Tensor w_q_, w_qa_, w_qa_norm_, w_qb_, w_kva_, w_kva_norm_, w_kvb_, w_o_;
  Tensor g_q_, g_qa_, g_qa_norm_, g_qb_, g_kva_, g_kva_norm_, g_kvb_, g_o_;
  // The projections' weight gradients: first writes.
  GradientWriter q_writer_, qa_writer_, qb_writer_, kva_writer_, kvb_writer_, o_writer_;
};

}  // namespace moetrain::model
