// defines: ModelConfig, the typed form of a Hugging Face config.json, and its parser. One struct
// serves every family; fields a family does not use keep their defaults. Spellings that differ
// between transformers versions (num_experts / num_local_experts, rope_theta / rope_parameters)
// are both accepted; missing required fields and unknown model types are errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moetrain::io {

enum class ModelFamily : uint8_t { Qwen3, Qwen3Moe };

struct ModelConfig {
  ModelFamily family = ModelFamily::Qwen3;
  std::string model_type;  // as written in config.json ("qwen3", "qwen3_moe")

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;           // defaults to hidden_size / num_attention_heads when absent
  int64_t intermediate_size = 0;  // dense MLP width
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;

  // Mixture of experts (qwen3_moe); num_experts == 0 means a dense model.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.0;

  bool is_moe() const { return num_experts > 0; }
  // True when decoder layer `layer` has a routed-expert MLP (qwen3_moe: not in mlp_only_layers,
  // and (layer + 1) % decoder_sparse_step == 0).
  bool layer_is_moe(int64_t layer) const;
};

// Parses config.json text. `source` names the file in error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
// Reads a config.json path, or a model folder holding one.
ModelConfig load_model_config(const std::string& path);
// The config.json that transformers would read back as the same model (for HF export).
std::string model_config_to_json(const ModelConfig& config);

}  // namespace moetrain::io
