// defines: the Qwen3.5 config fields' parser and writer.
#include "model/families/qwen3_5/config.h"

#include <cmath>
#include <optional>
#include <string>

#include "core/error.h"
#include "model/rope_fields.h"

namespace moetrain::model::families::qwen3_5 {

namespace {

using nlohmann::json;

// rope_theta and partial_rotary_factor, wherever transformers 5 or its older versions spell them. Only the default
// rope: mrope_section and mrope_interleaved (the multimodal models' 3-D positions) change nothing for text, whose
// three position axes are equal.
void parse_rope(const io::JsonFields& top, Qwen3_5Config& c) {
  const std::string& source = top.source();
  const RopeFields rope = parse_rope_fields(top, "qwen3_5", {"default"});
  if (rope.rope_theta) c.rope_theta = *rope.rope_theta;
  // absent: Qwen3_5TextConfig's 0.25
  if (rope.partial_rotary_factor) c.partial_rotary_factor = *rope.partial_rotary_factor;
  // transformers: dim = int(head_dim * partial_rotary_factor); the engine needs that product whole and even.
  const double rotary = double(c.head_dim) * c.partial_rotary_factor;
  MT_CHECK(rotary == std::floor(rotary) && c.rotary_dim() % 2 == 0,
           "{}: head_dim ({}) x partial_rotary_factor ({}) gives {} rotary dims; rope needs a whole, even number",
           source, c.head_dim, c.partial_rotary_factor, rotary);
}

// layer_types, or (absent) every full_attention_interval-th layer full attention, as Qwen3_5TextConfig.__post_init__;
// the legacy names "mamba" and "attention" read as transformers remaps them.
void parse_layer_types(const io::JsonFields& f, const ModelConfig& g, Qwen3_5Config& c) {
  const std::string& source = f.source();
  c.linear_layers.assign(static_cast<size_t>(g.num_hidden_layers), true);
  const std::optional<std::vector<std::string>> types = f.string_list_opt("layer_types");
  if (!types) {
    const int64_t interval = f.int_opt("full_attention_interval").value_or(4);
    f.check_positive(interval, "full_attention_interval");
    for (int64_t layer = 0; layer < g.num_hidden_layers; ++layer)
      c.linear_layers[static_cast<size_t>(layer)] = (layer + 1) % interval != 0;
    return;
  }
  MT_CHECK(static_cast<int64_t>(types->size()) == g.num_hidden_layers,
           "{}: layer_types has {} entries but num_hidden_layers is {}", source, types->size(), g.num_hidden_layers);
  for (size_t layer = 0; layer < types->size(); ++layer) {
    const std::string& type = (*types)[layer];
    const bool linear = type == "linear_attention" || type == "mamba";
    const bool full = type == "full_attention" || type == "attention";
    MT_CHECK(linear || full, "{}: layer_types[{}] '{}' is not supported for qwen3_5 (linear_attention, full_attention)",
             source, layer, type);
    c.linear_layers[layer] = linear;
  }
}

void parse_moe(const io::JsonFields& f, ModelConfig& g, Qwen3_5Config& c) {
  const std::string& source = f.source();
  g.num_experts = f.int_opt("num_experts").value_or(256);
  g.num_experts_per_tok = f.int_opt("num_experts_per_tok").value_or(8);
  c.moe_intermediate_size = f.int_opt("moe_intermediate_size").value_or(512);
  c.shared_expert_intermediate_size = f.int_opt("shared_expert_intermediate_size").value_or(512);
  c.router_aux_loss_coef = f.number_opt("router_aux_loss_coef").value_or(0.001);
  f.check_positive(g.num_experts, "num_experts");
  f.check_positive(g.num_experts_per_tok, "num_experts_per_tok");
  f.check_positive(c.moe_intermediate_size, "moe_intermediate_size");
  f.check_positive(c.shared_expert_intermediate_size, "shared_expert_intermediate_size");
  MT_CHECK(g.num_experts_per_tok <= g.num_experts, "{}: num_experts_per_tok ({}) exceeds num_experts ({})", source,
           g.num_experts_per_tok, g.num_experts);
  // Qwen3_5MoeTopKRouter always renormalises the top-k probabilities: a config that says otherwise means another model.
  MT_CHECK(f.bool_opt("norm_topk_prob").value_or(true),
           "{}: norm_topk_prob = false is not supported for qwen3_5_moe (transformers 5.17 always renormalises the "
           "top-k weights)",
           source);
  g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), true);
}

}  // namespace

int64_t Qwen3_5Config::rotary_dim() const {
  return static_cast<int64_t>(std::floor(double(head_dim) * partial_rotary_factor));
}

void parse_fields(const io::JsonFields& f, bool moe, ModelConfig& g, Qwen3_5Config& c) {
  const std::string& source = f.source();
  parse_model_shape(f, g);
  c.moe = moe;
  c.num_attention_heads = f.int_opt("num_attention_heads").value_or(16);
  c.num_key_value_heads = f.int_opt("num_key_value_heads").value_or(moe ? 2 : 4);
  c.head_dim = f.int_opt("head_dim").value_or(256);
  c.rms_norm_eps = parse_rms_norm_eps(f, 1e-6);
  f.check_positive(c.num_attention_heads, "num_attention_heads");
  f.check_positive(c.num_key_value_heads, "num_key_value_heads");
  f.check_positive(c.head_dim, "head_dim");
  MT_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
           "{}: num_attention_heads ({}) is not divisible by num_key_value_heads ({})", source, c.num_attention_heads,
           c.num_key_value_heads);
  parse_rope(f, c);
  c.max_position_embeddings = parse_max_position_embeddings(f);
  MT_CHECK(!f.bool_opt("attention_bias").value_or(false),
           "{}: attention_bias = true is not supported for qwen3_5 (the released models have no attention biases)",
           source);
  const double dropout = f.number_opt("attention_dropout").value_or(0.0);
  MT_CHECK(dropout == 0.0, "{}: attention_dropout {} is not supported (pre-training runs without dropout: 0)", source,
           dropout);
  require_silu_activation(f, "qwen3_5");

  c.linear_num_key_heads = f.int_opt("linear_num_key_heads").value_or(16);
  c.linear_num_value_heads = f.int_opt("linear_num_value_heads").value_or(32);
  c.linear_key_head_dim = f.int_opt("linear_key_head_dim").value_or(128);
  c.linear_value_head_dim = f.int_opt("linear_value_head_dim").value_or(128);
  c.linear_conv_kernel_dim = f.int_opt("linear_conv_kernel_dim").value_or(4);
  f.check_positive(c.linear_num_key_heads, "linear_num_key_heads");
  f.check_positive(c.linear_num_value_heads, "linear_num_value_heads");
  f.check_positive(c.linear_key_head_dim, "linear_key_head_dim");
  f.check_positive(c.linear_value_head_dim, "linear_value_head_dim");
  f.check_positive(c.linear_conv_kernel_dim, "linear_conv_kernel_dim");
  MT_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0,
           "{}: linear_num_value_heads ({}) is not divisible by linear_num_key_heads ({})", source,
           c.linear_num_value_heads, c.linear_num_key_heads);
  parse_layer_types(f, g, c);

  if (moe) {
    parse_moe(f, g, c);
  } else {
    c.intermediate_size = f.int_opt("intermediate_size").value_or(12288);
    f.check_positive(c.intermediate_size, "intermediate_size");
    g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), false);
  }
}

json fields_json(const ModelConfig& g, const Qwen3_5Config& c) {
  json j = model_shape_json(g);
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["rope_parameters"] = {
      {"rope_theta", c.rope_theta}, {"rope_type", "default"}, {"partial_rotary_factor", c.partial_rotary_factor}};
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  j["linear_num_key_heads"] = c.linear_num_key_heads;
  j["linear_num_value_heads"] = c.linear_num_value_heads;
  j["linear_key_head_dim"] = c.linear_key_head_dim;
  j["linear_value_head_dim"] = c.linear_value_head_dim;
  j["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  json types = json::array();
  for (bool linear : c.linear_layers) types.push_back(linear ? "linear_attention" : "full_attention");
  j["layer_types"] = types;
  if (c.moe) {
    j["num_experts"] = g.num_experts;
    j["num_experts_per_tok"] = g.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  } else {
    j["intermediate_size"] = c.intermediate_size;
  }
  return j;
}

}  // namespace moetrain::model::families::qwen3_5
