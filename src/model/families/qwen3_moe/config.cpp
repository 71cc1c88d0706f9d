// defines: the Qwen3-MoE expert fields' parser and writer.
#include "model/families/qwen3_moe/config.h"

#include <algorithm>
#include <optional>

#include "core/error.h"

namespace moetrain::model::families::qwen3_moe {

void parse_moe_fields(const io::JsonFields& f, ModelConfig& g, Qwen3MoeConfig& c) {
  const std::string& source = f.source();
  const std::optional<int64_t> experts = f.int_opt("num_experts");
  const std::optional<int64_t> local_experts = f.int_opt("num_local_experts");
  MT_CHECK(experts || local_experts, "{}: required field 'num_experts' (or 'num_local_experts') is missing", source);
  MT_CHECK(!experts || !local_experts || *experts == *local_experts,
           "{}: num_experts ({}) and num_local_experts ({}) disagree; keep one of them", source, experts.value_or(0),
           local_experts.value_or(0));
  g.num_experts = experts ? *experts : *local_experts;
  g.num_experts_per_tok = f.require_int("num_experts_per_tok");
  c.moe_intermediate_size = f.require_int("moe_intermediate_size");
  c.norm_topk_prob = f.bool_opt("norm_topk_prob").value_or(false);
  c.decoder_sparse_step = f.int_opt("decoder_sparse_step").value_or(1);
  c.mlp_only_layers = f.int_list_opt("mlp_only_layers").value_or(std::vector<int64_t>{});
  c.router_aux_loss_coef = f.number_opt("router_aux_loss_coef").value_or(0.0);

  f.check_positive(g.num_experts, "num_experts", kMaxExperts);
  f.check_positive(g.num_experts_per_tok, "num_experts_per_tok");
  f.check_positive(c.moe_intermediate_size, "moe_intermediate_size");
  f.check_positive(c.decoder_sparse_step, "decoder_sparse_step");
  MT_CHECK(g.num_experts_per_tok <= g.num_experts, "{}: num_experts_per_tok ({}) exceeds num_experts ({})", source,
           g.num_experts_per_tok, g.num_experts);
  for (int64_t layer : c.mlp_only_layers) {
    MT_CHECK(layer >= 0 && layer < g.num_hidden_layers,
             "{}: mlp_only_layers entry {} is outside [0, num_hidden_layers = {})", source, layer, g.num_hidden_layers);
  }
  g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), false);
  for (int64_t layer = 0; layer < g.num_hidden_layers; ++layer) {
    const bool dense = std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), layer) != c.mlp_only_layers.end();
    g.moe_layers[static_cast<size_t>(layer)] = !dense && (layer + 1) % c.decoder_sparse_step == 0;
  }
}

nlohmann::json moe_fields_json(const ModelConfig& g, const Qwen3MoeConfig& c) {
  nlohmann::json j;
  j["num_experts"] = g.num_experts;
  j["num_experts_per_tok"] = g.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["decoder_sparse_step"] = c.decoder_sparse_step;
  j["mlp_only_layers"] = c.mlp_only_layers;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  return j;
}

}  // namespace moetrain::model::families::qwen3_moe
