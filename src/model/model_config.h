// defines: ModelConfig, a model as every part of the engine above its family sees it: the sizes that shape the
// residual stream, the vocabulary and the expert banks, which layers route to experts, and an opaque handle on the
// family's own parsed fields (model/family.h), which only the family reads. parse_model_config finds the family of
// config.json's model_type in the registry and lets it parse the file; the readers of the fields several families
// spell alike (the shape, max_position_embeddings, hidden_act, rms_norm_eps) are here, so each is read one way.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/error.h"

namespace moetrain::io {
class JsonFields;
}  // namespace moetrain::io

namespace moetrain::model {

class Family;

// The family's own fields (attention shape, rope, routing options, ...): each family derives its config from this.
struct FamilyConfig {
  virtual ~FamilyConfig() = default;
};

struct ModelConfig {
  const Family* family = nullptr;
  std::string model_type;  // as written in config.json ("qwen3", "qwen3_moe", ...)
  std::string source;      // where it was read from (error messages)

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  bool tie_word_embeddings = false;

  // Routed experts of every MoE layer (0: a dense model) and the experts each token is sent to.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  std::vector<bool> moe_layers;  // per decoder layer: whether it routes to the expert bank

  std::shared_ptr<const FamilyConfig> details;
  // config.json as it was read (empty for a config built in code): the writer keeps the fields the engine does not
  // use (bos / eos / pad token ids, output_router_logits, ...) so an export means what its source meant (all but
  // quantization_config: the export is never quantised).
  std::string hf_source_json;

  bool is_moe() const { return num_experts > 0; }
  bool layer_is_moe(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(moe_layers.size()) && moe_layers[static_cast<size_t>(layer)];
  }
  int64_t num_moe_layers() const;
  // The position of MoE layer `layer` among the model's MoE layers (0, 1, ...); -1 for a dense layer.
  int64_t moe_index(int64_t layer) const;

  // The family's fields, as the family that parsed them knows their type.
  template <class T>
  const T& family_config() const {
    const T* typed = dynamic_cast<const T*>(details.get());
    MT_CHECK(typed != nullptr, "model config of '{}': the family's fields are missing or of another family",
             model_type);
    return *typed;
  }
};

// Bounds on the counts that multiply the parameter list: far above any released model (126 layers, 384 experts), and
// low enough that the specs of a refused config are never built.
inline constexpr int64_t kMaxLayers = int64_t{1} << 16;
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;

// The fields every family shares, read by each family's parser: vocab_size, hidden_size and num_hidden_layers
// (required, positive) and tie_word_embeddings (default false).
void parse_model_shape(const io::JsonFields& fields, ModelConfig& config);
// The fields parse_model_shape reads, as transformers writes them, with "dtype": "float32" (an export is f32).
nlohmann::json model_shape_json(const ModelConfig& config);

// Fields several families spell alike, read with one meaning and one refusal each:
// max_position_embeddings (absent or null: 0, "not given"; never negative);
int64_t parse_max_position_embeddings(const io::JsonFields& fields);
// hidden_act, which must be silu (absent: silu), the only activation of every family's MLPs;
void require_silu_activation(const io::JsonFields& fields, const std::string& family);
// rms_norm_eps (absent: `default_eps`), which must be positive;
double parse_rms_norm_eps(const io::JsonFields& fields, std::optional<double> default_eps = std::nullopt);
// the attention heads of grouped-query attention: num_attention_heads (required), num_key_value_heads (absent: one per
// query head; it must divide the query heads) and head_dim (absent: hidden_size / num_attention_heads, as
// transformers), each positive.
struct AttentionHeads {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
};
AttentionHeads parse_attention_heads(const io::JsonFields& fields, int64_t hidden_size);

// Parses config.json text; `source` names the file in errors. The family of its model_type parses the rest and
// refuses, by name, every value it does not support. A multimodal wrapper (Family::nested_config) is parsed as the
// model of its sub-object (Qwen3.5's text_config), with a log line naming what is left out.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
// Reads a config.json path, or a model folder holding one.
ModelConfig load_model_config(const std::string& path);
// The config.json that transformers would read back as the same model (for HF export): the family's fields, plus
// every other field of the config.json it was read from but quantization_config (the weights go out whole) and, when
// the family writes rope_parameters, the legacy rope_scaling and top-level rope_theta it supersedes.
std::string model_config_to_json(const ModelConfig& config);

}  // namespace moetrain::model
