// defines: the DeepSeek-V2 config.json parser and writer.
#include "model/families/deepseek_v2/config.h"

#include <optional>

#include "core/error.h"
#include "model/rope_fields.h"

namespace moetrain::model::families::deepseek_v2 {

namespace {

void parse_rope(const io::JsonFields& f, DeepseekV2Config& c) {
  const RopeFields rope = parse_rope_fields(f, "deepseek_v2", {"default", "yarn"});
  require_full_rotary(rope, f.source(), "deepseek_v2");
  if (rope.rope_theta) c.rope_theta = *rope.rope_theta;
  c.yarn = rope.yarn;
  // Checked now (each refusal names its field) rather than when the first layer is built.
  if (c.yarn) ops::rope_yarn_params(static_cast<int>(c.qk_rope_head_dim), c.rope_theta, *c.yarn);
}

}  // namespace

void parse_fields(const io::JsonFields& f, ModelConfig& g, DeepseekV2Config& c) {
  const std::string& source = f.source();
  parse_model_shape(f, g);
  c.num_attention_heads = f.require_int("num_attention_heads");
  c.intermediate_size = f.require_int("intermediate_size");
  c.moe_intermediate_size = f.require_int("moe_intermediate_size");
  c.rms_norm_eps = parse_rms_norm_eps(f);
  c.kv_lora_rank = f.require_int("kv_lora_rank");
  c.q_lora_rank = f.int_opt("q_lora_rank").value_or(0);  // null: a plain q_proj
  c.qk_nope_head_dim = f.require_int("qk_nope_head_dim");
  c.qk_rope_head_dim = f.require_int("qk_rope_head_dim");
  c.v_head_dim = f.require_int("v_head_dim");
  for (const auto& [value, name] : {std::pair{c.num_attention_heads, "num_attention_heads"},
                                    {c.intermediate_size, "intermediate_size"},
                                    {c.moe_intermediate_size, "moe_intermediate_size"},
                                    {c.kv_lora_rank, "kv_lora_rank"},
                                    {c.qk_nope_head_dim, "qk_nope_head_dim"},
                                    {c.qk_rope_head_dim, "qk_rope_head_dim"},
                                    {c.v_head_dim, "v_head_dim"}})
    f.check_positive(value, name);
  MT_CHECK(c.q_lora_rank >= 0, "{}: q_lora_rank must be null or positive but is {}", source, c.q_lora_rank);
  MT_CHECK(c.qk_rope_head_dim % 2 == 0, "{}: qk_rope_head_dim ({}) must be even (rope rotates pairs)", source,
           c.qk_rope_head_dim);
  // transformers' rope reads head_dim (the config sets it to qk_rope_head_dim); any other value would rotate another
  // number of dims than the rotary key has.
  if (const std::optional<int64_t> head_dim = f.int_opt("head_dim")) {
    MT_CHECK(*head_dim == c.qk_rope_head_dim, "{}: head_dim ({}) must equal qk_rope_head_dim ({}) for deepseek_v2",
             source, *head_dim, c.qk_rope_head_dim);
  }
  // Latent attention expands one key and value per head: transformers' repeat_kv needs as many kv heads as heads.
  const int64_t kv_heads = f.int_opt("num_key_value_heads").value_or(c.num_attention_heads);
  MT_CHECK(kv_heads == c.num_attention_heads,
           "{}: num_key_value_heads ({}) must equal num_attention_heads ({}) for deepseek_v2", source, kv_heads,
           c.num_attention_heads);
  parse_rope(f, c);
  c.max_position_embeddings = parse_max_position_embeddings(f);

  // Experts.
  const std::optional<int64_t> routed = f.int_opt("n_routed_experts");
  MT_CHECK(routed.has_value(), "{}: required field 'n_routed_experts' is missing", source);
  g.num_experts = *routed;
  g.num_experts_per_tok = f.require_int("num_experts_per_tok");
  c.n_shared_experts = f.int_opt("n_shared_experts").value_or(0);
  c.first_k_dense_replace = f.int_opt("first_k_dense_replace").value_or(0);
  f.check_positive(g.num_experts, "n_routed_experts", kMaxExperts);
  f.check_positive(g.num_experts_per_tok, "num_experts_per_tok");
  MT_CHECK(g.num_experts_per_tok <= g.num_experts, "{}: num_experts_per_tok ({}) exceeds n_routed_experts ({})", source,
           g.num_experts_per_tok, g.num_experts);
  MT_CHECK(c.n_shared_experts >= 0, "{}: n_shared_experts must not be negative but is {}", source, c.n_shared_experts);
  MT_CHECK(c.first_k_dense_replace >= 0 && c.first_k_dense_replace <= g.num_hidden_layers,
           "{}: first_k_dense_replace ({}) must be in [0, num_hidden_layers = {}]", source, c.first_k_dense_replace,
           g.num_hidden_layers);
  const int64_t freq = f.int_opt("moe_layer_freq").value_or(1);
  MT_CHECK(
      freq == 1,
      "{}: moe_layer_freq {} is not supported (transformers 5.17 makes every layer from first_k_dense_replace on an "
      "MoE layer, which is moe_layer_freq 1)",
      source, freq);
  c.topk_method = f.string_opt("topk_method").value_or("greedy");
  MT_CHECK(c.topk_method == "greedy" || c.topk_method == "group_limited_greedy",
           "{}: topk_method '{}' is not supported (greedy, group_limited_greedy)", source, c.topk_method);
  c.n_group = f.int_opt("n_group").value_or(1);
  c.topk_group = f.int_opt("topk_group").value_or(1);
  f.check_positive(c.n_group, "n_group");
  f.check_positive(c.topk_group, "topk_group");
  if (c.topk_method == "group_limited_greedy") {
    MT_CHECK(g.num_experts % c.n_group == 0 && c.topk_group <= c.n_group,
             "{}: group_limited_greedy needs n_routed_experts ({}) divisible by n_group ({}) and topk_group ({}) <= "
             "n_group",
             source, g.num_experts, c.n_group, c.topk_group);
  }
  c.routed_scaling_factor = f.number_opt("routed_scaling_factor").value_or(1.0);
  MT_CHECK(c.routed_scaling_factor > 0.0, "{}: routed_scaling_factor must be positive but is {}", source,
           c.routed_scaling_factor);
  c.norm_topk_prob = f.bool_opt("norm_topk_prob").value_or(false);
  const std::string scoring = f.string_opt("scoring_func").value_or("softmax");
  MT_CHECK(scoring == "softmax", "{}: scoring_func '{}' is not supported for deepseek_v2 (only 'softmax')", source,
           scoring);

  // What transformers' DeepSeek-V2 would run differently from the engine.
  MT_CHECK(!f.bool_opt("attention_bias").value_or(false), "{}: attention_bias = true is not supported for deepseek_v2",
           source);
  MT_CHECK(!f.bool_opt("mlp_bias").value_or(false), "{}: mlp_bias = true is not supported for deepseek_v2", source);
  require_silu_activation(f, "deepseek_v2");

  g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), false);
  for (int64_t layer = c.first_k_dense_replace; layer < g.num_hidden_layers; ++layer)
    g.moe_layers[static_cast<size_t>(layer)] = true;
}

nlohmann::json fields_json(const ModelConfig& g, const DeepseekV2Config& c) {
  nlohmann::json j = model_shape_json(g);
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_attention_heads;
  j["intermediate_size"] = c.intermediate_size;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["q_lora_rank"] = c.q_lora_rank > 0 ? nlohmann::json(c.q_lora_rank) : nlohmann::json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["head_dim"] = c.qk_rope_head_dim;
  nlohmann::json rope = {{"rope_theta", c.rope_theta}, {"rope_type", c.yarn ? "yarn" : "default"}};
  if (c.yarn) add_yarn_fields(rope, *c.yarn);
  j["rope_parameters"] = rope;
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  j["n_routed_experts"] = g.num_experts;
  j["num_experts_per_tok"] = g.num_experts_per_tok;
  j["n_shared_experts"] = c.n_shared_experts;
  j["first_k_dense_replace"] = c.first_k_dense_replace;
  j["moe_layer_freq"] = 1;
  j["topk_method"] = c.topk_method;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["scoring_func"] = "softmax";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  return j;
}

}  // namespace moetrain::model::families::deepseek_v2
