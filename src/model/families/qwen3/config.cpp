// defines: the Qwen3 config fields' parser and writer, and the attention options they imply.
#include "model/families/qwen3/config.h"

#include <cmath>
#include <optional>
#include <string>

#include "core/error.h"
#include "model/rope_fields.h"

namespace moetrain::model::families::qwen3 {

namespace {

using nlohmann::json;

// rope_theta and partial_rotary_factor, wherever transformers 5 or its older versions spell them; only the plain
// (unscaled) rotary embedding.
void parse_rope(const io::JsonFields& top, Qwen3Config& c) {
  const RopeFields rope = parse_rope_fields(top, "qwen3 / qwen3_moe", {"default"});
  if (rope.rope_theta) c.rope_theta = *rope.rope_theta;
  if (rope.partial_rotary_factor) c.partial_rotary_factor = *rope.partial_rotary_factor;
}

int64_t rotary_dim(const Qwen3Config& c) {
  return static_cast<int64_t>(std::llround(double(c.head_dim) * c.partial_rotary_factor));
}

}  // namespace

void parse_shared_fields(const io::JsonFields& f, ModelConfig& g, Qwen3Config& c) {
  const std::string& source = f.source();
  parse_model_shape(f, g);
  const AttentionHeads heads = parse_attention_heads(f, g.hidden_size);
  c.num_attention_heads = heads.num_attention_heads;
  c.num_key_value_heads = heads.num_key_value_heads;
  c.head_dim = heads.head_dim;
  c.intermediate_size = f.require_int("intermediate_size");
  f.check_positive(c.intermediate_size, "intermediate_size");
  c.rms_norm_eps = parse_rms_norm_eps(f);

  parse_rope(f, c);
  const double rotary = double(c.head_dim) * c.partial_rotary_factor;
  MT_CHECK(rotary == std::round(rotary) && rotary_dim(c) % 2 == 0,
           "{}: head_dim ({}) x partial_rotary_factor ({}) gives {} rotary dims; rope needs a whole, even number",
           source, c.head_dim, c.partial_rotary_factor, rotary);

  MT_CHECK(!f.bool_opt("attention_bias").value_or(false),
           "{}: attention_bias = true is not supported for qwen3 / qwen3_moe", source);
  MT_CHECK(!f.bool_opt("use_sliding_window").value_or(false),
           "{}: use_sliding_window = true is not supported for qwen3 / qwen3_moe", source);
  require_silu_activation(f, "qwen3 / qwen3_moe");
  c.max_position_embeddings = parse_max_position_embeddings(f);
}

json shared_fields_json(const ModelConfig& g, const Qwen3Config& c) {
  json j = model_shape_json(g);
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  json rope = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  if (c.partial_rotary_factor != 1.0) rope["partial_rotary_factor"] = c.partial_rotary_factor;
  j["rope_parameters"] = rope;
  j["attention_bias"] = false;
  // 0 means "not given": leave it out so transformers applies its own default.
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  return j;
}

AttentionOptions attention_options(const ModelConfig& g, const Qwen3Config& c) {
  AttentionOptions o;
  o.hidden_size = g.hidden_size;
  o.num_heads = c.num_attention_heads;
  o.num_kv_heads = c.num_key_value_heads;
  o.head_dim = c.head_dim;
  o.qk_norm = true;
  o.norm_eps = static_cast<float>(c.rms_norm_eps);
  o.rope = ops::rope_default_params(static_cast<int>(rotary_dim(c)), c.rope_theta);
  return o;
}

}  // namespace moetrain::model::families::qwen3
