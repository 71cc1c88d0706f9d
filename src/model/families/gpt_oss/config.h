// defines: GptOssConfig, the fields of a GPT-OSS config.json the engine uses (transformers 5.17's GptOssConfig), and
// their parser and writer. transformers hard-codes some of what the released configs spell (the clamped SwiGLU's
// limit 7.0, the silu activation name): such a field is accepted only with the value the model then behaves by, so a
// config never means two things.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "model/model_config.h"
#include "ops/rope.h"

namespace moetrain::model::families::gpt_oss {

// transformers' GptOssExperts: alpha and limit are constants of the module, not config fields.
inline constexpr float kSwigluAlpha = 1.702f;
inline constexpr float kSwigluLimit = 7.0f;

struct GptOssConfig : FamilyConfig {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;  // each expert's width
  double rms_norm_eps = 1e-5;
  bool attention_bias = true;  // biases on q, k, v and o
  int64_t sliding_window = 0;  // the window of the "sliding_attention" layers
  std::vector<bool> sliding_layers;  // per layer: "sliding_attention" (true) or "full_attention"
  double rope_theta = 150000.0;      // GptOssConfig.default_theta
  std::optional<ops::YarnOptions> yarn;  // rope_type "yarn" (the released models); empty: the default rope
  int64_t max_position_embeddings = 0;
  double router_aux_loss_coef = 0.0;  // read and written back (the job's loss settings decide the training loss)
  bool mxfp4_checkpoint = false;      // quantization_config.quant_method "mxfp4": experts stored as MXFP4 blocks
};

// Reads the generic fields into `generic` and the family's into `own`; refuses every value it does not run.
void parse_fields(const io::JsonFields& fields, ModelConfig& generic, GptOssConfig& own);
// The fields as transformers writes them (never a quantization_config: exports are float).
nlohmann::json fields_json(const ModelConfig& generic, const GptOssConfig& own);

}  // namespace moetrain::model::families::gpt_oss
