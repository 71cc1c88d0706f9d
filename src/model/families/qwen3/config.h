// defines: Qwen3Config, the fields of a Qwen3 config.json the engine uses (the attention shape, rope, the dense
// MLP), their parser and writer. Qwen3-MoE's config (families/qwen3_moe/) extends it: the two share the decoder
// layer's attention, norms and HF names.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "model/blocks/attention.h"
#include "model/model_config.h"

namespace moetrain::model::families::qwen3 {

struct Qwen3Config : FamilyConfig {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;           // config.head_dim, or hidden_size / num_attention_heads when absent
  int64_t intermediate_size = 0;  // the dense MLP's width
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  int64_t max_position_embeddings = 0;  // 0: not given
};

// Reads the fields Qwen3 and Qwen3-MoE share into `generic` (vocabulary, hidden size, layers, tied head) and `own`;
// refuses what transformers' Qwen3 would not run as the engine does: attention biases, a sliding window, another
// activation than silu, scaled rope, a rotary dimension that is not even.
void parse_shared_fields(const io::JsonFields& fields, ModelConfig& generic, Qwen3Config& own);
// The same fields as transformers writes them.
nlohmann::json shared_fields_json(const ModelConfig& generic, const Qwen3Config& own);

// The attention block of every layer; its rope covers round(head_dim * partial_rotary_factor) dims.
AttentionOptions attention_options(const ModelConfig& generic, const Qwen3Config& own);

}  // namespace moetrain::model::families::qwen3
