// defines: the GPT-OSS config.json parser and writer.
#include "model/families/gpt_oss/config.h"

#include <optional>

#include "core/error.h"
#include "model/rope_fields.h"

namespace moetrain::model::families::gpt_oss {

namespace {

// rope_parameters (transformers 5) or rope_scaling with rope_theta at the top level (the released configs, written by
// transformers 4.55). No rope dict at all is GptOssConfig's default: YaRN with factor 32 over 4096 positions.
void parse_rope(const io::JsonFields& f, GptOssConfig& c) {
  const RopeFields rope = parse_rope_fields(f, "gpt_oss", {"default", "yarn"});
  require_full_rotary(rope, f.source(), "gpt_oss");
  if (rope.rope_theta) c.rope_theta = *rope.rope_theta;
  c.yarn = rope.yarn;
  if (!rope.any_rope_dict) {
    ops::YarnOptions y;
    y.factor = 32.0;
    y.beta_fast = 32.0;
    y.beta_slow = 1.0;
    y.truncate = false;
    y.original_max_position_embeddings = 4096;
    c.yarn = y;
  }
  if (c.yarn) ops::rope_yarn_params(static_cast<int>(c.head_dim), c.rope_theta, *c.yarn);  // refusals name the field
}

void parse_layer_types(const io::JsonFields& f, const ModelConfig& g, GptOssConfig& c) {
  const std::string& source = f.source();
  const std::optional<std::vector<std::string>> types = f.string_list_opt("layer_types");
  c.sliding_layers.assign(static_cast<size_t>(g.num_hidden_layers), false);
  if (!types) {  // GptOssConfig: even layers slide, odd layers attend to everything
    for (int64_t layer = 0; layer < g.num_hidden_layers; layer += 2)
      c.sliding_layers[static_cast<size_t>(layer)] = true;
    return;
  }
  MT_CHECK(static_cast<int64_t>(types->size()) == g.num_hidden_layers,
           "{}: layer_types has {} entries but num_hidden_layers is {}", source, types->size(), g.num_hidden_layers);
  for (size_t layer = 0; layer < types->size(); ++layer) {
    const std::string& type = (*types)[layer];
    MT_CHECK(type == "sliding_attention" || type == "full_attention",
             "{}: layer_types[{}] '{}' is not supported for gpt_oss (sliding_attention, full_attention)", source, layer,
             type);
    c.sliding_layers[layer] = type == "sliding_attention";
  }
}

}  // namespace

void parse_fields(const io::JsonFields& f, ModelConfig& g, GptOssConfig& c) {
  const std::string& source = f.source();
  parse_model_shape(f, g);
  const AttentionHeads heads = parse_attention_heads(f, g.hidden_size);
  c.num_attention_heads = heads.num_attention_heads;
  c.num_key_value_heads = heads.num_key_value_heads;
  c.head_dim = heads.head_dim;
  c.intermediate_size = f.require_int("intermediate_size");
  f.check_positive(c.intermediate_size, "intermediate_size");
  c.rms_norm_eps = parse_rms_norm_eps(f, 1e-5);
  MT_CHECK(c.head_dim % 2 == 0, "{}: head_dim ({}) must be even (rope rotates pairs)", source, c.head_dim);
  c.attention_bias = f.bool_opt("attention_bias").value_or(true);
  const double dropout = f.number_opt("attention_dropout").value_or(0.0);
  MT_CHECK(dropout == 0.0, "{}: attention_dropout {} is not supported (pre-training runs without dropout: 0)", source,
           dropout);

  c.sliding_window = f.int_opt("sliding_window").value_or(0);  // null: the sliding layers see the whole document
  MT_CHECK(c.sliding_window >= 0, "{}: sliding_window must be null or positive but is {}", source, c.sliding_window);
  parse_layer_types(f, g, c);
  parse_rope(f, c);
  c.max_position_embeddings = parse_max_position_embeddings(f);

  // Experts: every layer routes.
  const std::optional<int64_t> experts = f.int_opt("num_local_experts");
  MT_CHECK(experts.has_value(), "{}: required field 'num_local_experts' is missing", source);
  g.num_experts = *experts;
  g.num_experts_per_tok = f.require_int("num_experts_per_tok");
  f.check_positive(g.num_experts, "num_local_experts", kMaxExperts);
  f.check_positive(g.num_experts_per_tok, "num_experts_per_tok");
  MT_CHECK(g.num_experts_per_tok <= g.num_experts, "{}: num_experts_per_tok ({}) exceeds num_local_experts ({})",
           source, g.num_experts_per_tok, g.num_experts);
  // The released configs also spell the top-k as experts_per_token, which transformers 5.17 does not read.
  if (const std::optional<int64_t> k = f.int_opt("experts_per_token")) {
    MT_CHECK(*k == g.num_experts_per_tok, "{}: experts_per_token ({}) differs from num_experts_per_tok ({})", source,
             *k, g.num_experts_per_tok);
  }
  if (const std::optional<double> limit = f.number_opt("swiglu_limit")) {
    MT_CHECK(*limit == double(kSwigluLimit),
             "{}: swiglu_limit {} is not supported (transformers 5.17's GPT-OSS experts clamp at {} whatever the "
             "config says)",
             source, *limit, kSwigluLimit);
  }
  require_silu_activation(f, "gpt_oss");
  c.router_aux_loss_coef = f.number_opt("router_aux_loss_coef").value_or(0.0);
  if (const std::optional<io::JsonFields> quant = f.object_opt("quantization_config")) {
    const std::string method = quant->string_opt("quant_method").value_or("");
    MT_CHECK(method == "mxfp4",
             "{}: quantization_config.quant_method '{}' is not supported for gpt_oss (only 'mxfp4', dequantised on "
             "load)",
             source, method);
    c.mxfp4_checkpoint = true;
  }
  g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), true);
}

nlohmann::json fields_json(const ModelConfig& g, const GptOssConfig& c) {
  nlohmann::json j = model_shape_json(g);
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["attention_bias"] = c.attention_bias;
  j["attention_dropout"] = 0.0;
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  nlohmann::json types = nlohmann::json::array();
  for (bool sliding : c.sliding_layers) types.push_back(sliding ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
  nlohmann::json rope = {{"rope_theta", c.rope_theta}, {"rope_type", c.yarn ? "yarn" : "default"}};
  if (c.yarn) add_yarn_fields(rope, *c.yarn);
  j["rope_parameters"] = rope;
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  j["num_local_experts"] = g.num_experts;
  j["num_experts_per_tok"] = g.num_experts_per_tok;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  return j;
}

}  // namespace moetrain::model::families::gpt_oss
