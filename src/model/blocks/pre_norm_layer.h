// defines: PreNormLayer, the decoder layer of a pre-norm transformer as the five-stage protocol, built from the
// generic blocks by a family: stage 1 = input RMSNorm, a token mixer (attention or another), the residual add and
// the post-mixer RMSNorm, then the router of an MoE layer and the permutation of its tokens into expert order;
// stage 3 = the expert bank (or the dense MLP); stage 5 = the weighted un-permutation, the shared expert if any, and
// the residual. Which of these a layer has is in its options; it knows no family and no HF name.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/blocks/gated_mlp.h"
#include "model/blocks/router.h"
#include "model/blocks/shared_expert.h"
#include "model/blocks/token_mixer.h"
#include "model/decoder_layer.h"
#include "model/parameter_store.h"
#include "ops/norm.h"

namespace moetrain::model {

struct MoeOptions {
  RouterOptions router;
  GatedMlpOptions experts;  // num_experts > 0, role ExpertBank
  std::optional<SharedExpertOptions> shared_expert;
};

struct PreNormLayerOptions {
  int64_t layer = 0;       // the decoder layer's index in the model
  int64_t moe_index = -1;  // its position among the MoE layers (router losses); -1: dense
  int64_t hidden_size = 0;
  ops::RmsNormParams norm;  // the input and post-mixer norms
  // Exactly one of the two: a dense MLP, or a routed expert bank.
  std::optional<GatedMlpOptions> dense_mlp;
  std::optional<MoeOptions> moe;
};

class PreNormLayer final : public DecoderLayer {
 public:
  // The layer's parameters in order: "<prefix>input_norm", the token mixer's `mixer_specs` (which the family builds,
  // e.g. GqaAttention::param_specs under "<prefix>attn."), "<prefix>post_norm", then "mlp.{gate_up,down}" or "router",
  // "experts.{gate_up,down}" and "shared_expert.{gate_up,down}".
  static std::vector<ParamSpec> param_specs(const PreNormLayerOptions& options, std::vector<ParamSpec> mixer_specs,
                                            const std::string& prefix);

  PreNormLayer(const PreNormLayerOptions& options, std::unique_ptr<TokenMixer> mixer, ParameterStore& store,
               const std::string& prefix);

  int64_t index() const override { return options_.layer; }
  bool has_experts() const override { return router_ != nullptr; }
  std::string decoding_support() const override { return mixer_->decoding_support(); }

  std::unique_ptr<LayerRecord> new_record() const override;
  void set_recompute_activation(bool on) override;
  Dispatch stage1_forward(LayerRecord& record, const Tensor& hidden, const MicroBatch& batch) const override;
  Tensor stage3_forward(LayerRecord& record, const Tensor& rows, const Tensor& group_offsets) const override;
  Tensor stage5_forward(LayerRecord& record, const Tensor& combined) const override;

  Tensor stage5_backward_input(LayerRecord& record, const Tensor& d_out) const override;
  Tensor stage3_backward_input(LayerRecord& record, const Tensor& d_combined) const override;
  void stage3_backward_weight(LayerRecord& record) const override;
  std::unique_ptr<LayerRecord> take_stage3_weight_work(LayerRecord& record, bool own_rows) const override;
  void stage3_backward_weight_together(const std::vector<LayerRecord*>& records) const override;
  Tensor stage1_backward_input(LayerRecord& record, const Tensor& d_dispatched) const override;
  void stage1_backward_weight(LayerRecord& record) const override;

 private:
  PreNormLayerOptions options_;
  // The activations' dtype (the store's compute dtype). The residual stream (the stage-1 input, the stage-5 output and
  // their gradients) keeps the dtype it arrives in: the compute dtype, or f32 under bf16 compute (as autocast keeps
  // it); the norms read it and write the compute dtype.
  DType compute_dtype_;
  std::unique_ptr<TokenMixer> mixer_;
  Tensor w_input_norm_, g_input_norm_, w_post_norm_, g_post_norm_;
  std::unique_ptr<Router> router_;               // MoE layers only
  std::unique_ptr<SharedExpert> shared_expert_;  // MoE layers with one
  GatedMlp mlp_;                                 // the experts of an MoE layer, or the dense MLP
};

}  // namespace moetrain::model
