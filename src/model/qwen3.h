// defines: the Qwen3 and Qwen3-MoE family: its parameter layout (HF names <-> internal) and its
// decoder layer as the five-stage protocol. A Qwen3-MoE layer listed in mlp_only_layers (or off
// the decoder_sparse_step) is a dense layer, exactly as transformers builds it.
#pragma once

#include <memory>
#include <vector>

#include "io/model_config.h"
#include "model/decoder_layer.h"
#include "model/parameter_store.h"

namespace moetrain::model {

std::vector<ParamSpec> qwen3_param_specs(const io::ModelConfig& config);

class Qwen3DecoderLayer final : public DecoderLayer {
 public:
  Qwen3DecoderLayer(const io::ModelConfig& config, ParameterStore& store, int64_t layer);

  int64_t index() const override { return layer_; }
  bool has_experts() const override { return router_ != nullptr; }
  int64_t moe_index() const override { return moe_index_; }

  Stage1Out stage1_forward(Stage1Record& record, const Tensor& hidden, const MicroBatch& batch) const override;
  Tensor stage3_forward(Stage3Record& record, const Tensor& dispatched, const Tensor& group_offsets) const override;
  Tensor stage5_forward(Stage5Record& record, const Tensor& combined, const Stage1Out& stage1) const override;

  Stage5Grads stage5_backward_input(Stage5Record& record, const Tensor& d_out) const override;
  Tensor stage3_backward_input(Stage3Record& record, const Tensor& d_combined) const override;
  void stage3_backward_weight(Stage3Record& record) const override;
  Tensor stage1_backward_input(Stage1Record& record, const Stage5Grads& grads,
                               const Tensor& d_dispatched) const override;
  void stage1_backward_weight(Stage1Record& record) const override;

 private:
  int64_t layer_;
  int64_t moe_index_ = -1;
  ops::RmsNormParams norm_;
  Tensor w_input_norm_, g_input_norm_, w_post_norm_, g_post_norm_;
  AttentionBlock attention_;
  std::unique_ptr<RouterBlock> router_;  // MoE layers only
  GatedMlp mlp_;                         // the experts of an MoE layer, or the dense MLP
};

}  // namespace moetrain::model
