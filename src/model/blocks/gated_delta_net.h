// defines: GatedDeltaNet, Qwen3.5's linear-attention token mixer (transformers 5.17's Qwen3_5GatedDeltaNet), driven by
// GatedDeltaNetOptions: in_proj_qkv, a short causal depthwise conv with SiLU over the q, k and v channels, q and k
// L2-normalised per head, the gates g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) from in_proj_a and
// in_proj_b, the gated delta rule over each packed document (scale 1 / sqrt(key head dim); the conv and the recurrence
// both restart at every document), the output RMSNorm gated by silu(z) from in_proj_z, and out_proj. It knows no HF
// names: the family maps its parameters.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/batch.h"
#include "model/blocks/token_mixer.h"
#include "model/parameter_store.h"

namespace moetrain::model {

class DecodeCache;

struct GatedDeltaNetOptions {
  int64_t hidden_size = 0;
  int64_t num_key_heads = 0;    // Hk: q and k heads
  int64_t num_value_heads = 0;  // Hv, a multiple of Hk: value head h reads key head h / (Hv / Hk)
  int64_t key_head_dim = 0;     // dk
  int64_t value_head_dim = 0;   // dv
  int64_t conv_kernel = 4;      // K
  float norm_eps = 1e-6f;       // the gated output norm's
};

class GatedDeltaNet final : public TokenMixer {
 public:
  // Parameters, in decoder layer `layer`, no HF pieces (C = 2 Hk dk + Hv dv, the conv's channels q, k, v):
  // "<prefix>in_proj_qkv" [C, H], "<prefix>in_proj_z" [Hv dv, H], "<prefix>in_proj_a" and "<prefix>in_proj_b" [Hv, H],
  // "<prefix>conv" [C, K], "<prefix>A_log" and "<prefix>dt_bias" [Hv] (f32 pins "A_log" and "dt_bias"; start 0 and 1),
  // "<prefix>norm" [dv] (role Norm, starts 1), "<prefix>out_proj" [H, Hv dv].
  static std::vector<ParamSpec> param_specs(const GatedDeltaNetOptions& options, const std::string& prefix,
                                            int64_t layer);

  GatedDeltaNet(const GatedDeltaNetOptions& options, ParameterStore& store, const std::string& prefix);

  std::unique_ptr<MixerRecord> new_record() const override;
  Tensor forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const override;
  Tensor backward_input(MixerRecord& record, const Tensor& d_out) const override;
  void backward_weight(MixerRecord& record) const override;
  // Generation keeps every sequence's conv inputs and its recurrent state per value head (model/decode_cache.h); a
  // step runs the forward's per-token code on them (ops::causal_conv1d_silu_decode, ops::gated_delta_rule_decode).
  std::string decoding_support() const override { return ""; }

  int64_t conv_channels() const;

 private:
  // Its part of a generation's cache: the conv inputs [B, capacity, conv channels] and the rule's state [B, Hv, dk,
  // dv] of every sequence (views of the tensors the cache holds).
  struct DecodeState {
    Tensor conv_inputs, rule_state;
  };
  DecodeState decode_state(DecodeCache& cache, int64_t channels, DType dtype, Device device) const;
  void keep_conv_inputs(const DecodeState& state, const Tensor& qkv, const MicroBatch& batch) const;

  GatedDeltaNetOptions options_;
  float scale_ = 1.0f;
  Tensor w_qkv_, w_z_, w_a_, w_b_, w_conv_, w_a_log_, w_dt_bias_, w_norm_, w_out_;
  Tensor g_qkv_, g_z_, g_a_, g_b_, g_conv_, g_a_log_, g_dt_bias_, g_norm_, g_out_;
  GradientWriter qkv_writer_, z_writer_, a_writer_, b_writer_, out_writer_;  // the projections' first writes
};

}  // namespace moetrain::model
