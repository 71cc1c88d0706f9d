// defines: DeepseekV2Config, the fields of a DeepSeek-V2 config.json the engine uses, and their parser and writer.
// transformers 5.17 reads some fields and ignores others (norm_topk_prob, moe_layer_freq, scoring_func): a value it
// ignores is accepted only when it is the value the model then behaves by, so a config never means two things.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "model/model_config.h"
#include "ops/rope.h"

namespace moetrain::model::families::deepseek_v2 {

struct DeepseekV2Config : FamilyConfig {
  int64_t num_attention_heads = 0;
  int64_t intermediate_size = 0;      // the dense layers' MLP
  int64_t moe_intermediate_size = 0;  // each routed expert, and each shared expert
  double rms_norm_eps = 1e-6;
  // Latent attention.
  int64_t q_lora_rank = 0;  // 0: null in config.json, a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double rope_theta = 10000.0;
  std::optional<ops::YarnOptions> yarn;  // rope_type "yarn": its frequencies, and the softmax scale's mscale
  int64_t max_position_embeddings = 0;
  // Routing.
  int64_t n_shared_experts = 0;
  int64_t first_k_dense_replace = 0;
  std::string topk_method = "greedy";  // greedy | group_limited_greedy
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = false;  // read and written back; transformers' DeepSeek-V2 router does not renormalise
};

// Reads the generic fields into `generic` and the family's into `own`; refuses every value it does not run.
void parse_fields(const io::JsonFields& fields, ModelConfig& generic, DeepseekV2Config& own);
nlohmann::json fields_json(const ModelConfig& generic, const DeepseekV2Config& own);

}  // namespace moetrain::model::families::deepseek_v2
