// defines: Qwen3MoeConfig, Qwen3's fields plus the expert fields of a Qwen3-MoE config.json, and their parser.
#pragma once

#include <cstdint>
#include <vector>

#include "model/families/qwen3/config.h"

namespace moetrain::model::families::qwen3_moe {

struct Qwen3MoeConfig : qwen3::Qwen3Config {
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.0;
};

// Parses the expert fields (num_experts or num_local_experts, num_experts_per_tok, ...) into `generic` and `own`,
// and marks the MoE layers: those not in mlp_only_layers with (layer + 1) % decoder_sparse_step == 0.
void parse_moe_fields(const io::JsonFields& fields, ModelConfig& generic, Qwen3MoeConfig& own);
nlohmann::json moe_fields_json(const ModelConfig& generic, const Qwen3MoeConfig& own);

}  // namespace moetrain::model::families::qwen3_moe
