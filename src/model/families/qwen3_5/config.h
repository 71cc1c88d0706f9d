// defines: Qwen3_5Config, the fields of a Qwen3.5 config.json the engine uses (transformers 5.17's Qwen3_5TextConfig
// and Qwen3_5MoeTextConfig: the hybrid layout of Gated DeltaNet and full-attention layers, both mixers' shapes, the
// dense MLP or the routed experts with their gated shared expert), their parser and writer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "model/model_config.h"

namespace moetrain::model::families::qwen3_5 {

// The model types of the text models; the multimodal wrappers ("qwen3_5", "qwen3_5_moe") hold one as text_config.
inline constexpr const char* kDenseTextType = "qwen3_5_text";
inline constexpr const char* kMoeTextType = "qwen3_5_moe_text";

struct Qwen3_5Config : FamilyConfig {
  bool moe = false;  // qwen3_5_moe_text: every layer routes, with a gated shared expert

  // Full attention (the "full_attention" layers): q_proj emits the query and a sigmoid output gate per head.
  int64_t num_attention_heads = 16;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 256;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;
  int64_t max_position_embeddings = 0;  // 0: not given

  // Gated DeltaNet (the "linear_attention" layers).
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_conv_kernel_dim = 4;
  std::vector<bool> linear_layers;  // per layer: "linear_attention" (true) or "full_attention"

  int64_t intermediate_size = 0;  // the dense MLP's width (dense models)
  // MoE models: each expert's width, the shared expert's width, and the auxiliary loss coefficient (read and written
  // back: the job's loss settings decide the training loss).
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  double router_aux_loss_coef = 0.001;

  int64_t rotary_dim() const;
};

// Reads a qwen3_5_text (moe = false) or qwen3_5_moe_text (moe = true) config object into `generic` and `own`, with
// transformers' defaults for absent fields; refuses every value it does not run, naming the field.
void parse_fields(const io::JsonFields& fields, bool moe, ModelConfig& generic, Qwen3_5Config& own);
// The fields as transformers writes them (a text model's config.json).
nlohmann::json fields_json(const ModelConfig& generic, const Qwen3_5Config& own);

}  // namespace moetrain::model::families::qwen3_5
