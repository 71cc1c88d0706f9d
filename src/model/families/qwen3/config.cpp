// defines: the Qwen3 config fields' parser and writer, and the attention options they imply.
#include "model/families/qwen3/config.h"

#include <cmath>
#include <optional>
#include <string>

#include "core/error.h"

namespace moetrain::model::families::qwen3 {

namespace {

using nlohmann::json;

// Checks a rope type: these families only have the plain (unscaled) rotary embedding.
void check_rope_type(const std::string& rope_type, const std::string& field, const std::string& source) {
  MT_CHECK(rope_type == "default",
           "{}: {} '{}' is not supported for qwen3 / qwen3_moe (only 'default', no rope scaling)", source, field,
           rope_type);
}

// rope_theta and partial_rotary_factor: transformers 5 keeps them in rope_parameters, older versions at the top
// level next to rope_scaling (null for no scaling). Both are accepted; when both spell a value they must agree.
void parse_rope(const io::JsonFields& top, Qwen3Config& c) {
  const std::string& source = top.source();
  std::optional<double> theta = top.number_opt("rope_theta");
  std::optional<double> partial = top.number_opt("partial_rotary_factor");
  const auto merge = [&](std::optional<double>& into, std::optional<double> value, const char* name) {
    if (!value) return;
    MT_CHECK(!into || *into == *value, "{}: {} is {} at the top level but {} in rope_parameters", source, name, *into,
             *value);
    into = value;
  };
  if (const std::optional<io::JsonFields> rope = top.object_opt("rope_parameters")) {
    if (auto type = rope->string_opt("rope_type")) check_rope_type(*type, "rope_parameters.rope_type", source);
    if (auto type = rope->string_opt("type")) check_rope_type(*type, "rope_parameters.type", source);
    merge(theta, rope->number_opt("rope_theta"), "rope_theta");
    merge(partial, rope->number_opt("partial_rotary_factor"), "partial_rotary_factor");
  }
  if (const std::optional<io::JsonFields> scaling = top.object_opt("rope_scaling")) {
    if (auto type = scaling->string_opt("rope_type")) check_rope_type(*type, "rope_scaling.rope_type", source);
    if (auto type = scaling->string_opt("type")) check_rope_type(*type, "rope_scaling.type", source);
  }
  if (theta) c.rope_theta = *theta;
  if (partial) c.partial_rotary_factor = *partial;
  MT_CHECK(c.rope_theta > 0.0, "{}: rope_theta must be positive but is {}", source, c.rope_theta);
  MT_CHECK(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0,
           "{}: partial_rotary_factor must be in (0, 1] but is {}", source, c.partial_rotary_factor);
}

int64_t rotary_dim(const Qwen3Config& c) {
  return static_cast<int64_t>(std::llround(double(c.head_dim) * c.partial_rotary_factor));
}

}  // namespace

void parse_shared_fields(const io::JsonFields& f, ModelConfig& g, Qwen3Config& c) {
  const std::string& source = f.source();
  parse_model_shape(f, g);
  c.num_attention_heads = f.require_int("num_attention_heads");
  c.intermediate_size = f.require_int("intermediate_size");
  c.rms_norm_eps = f.require_number("rms_norm_eps");
  f.check_positive(c.num_attention_heads, "num_attention_heads");
  f.check_positive(c.intermediate_size, "intermediate_size");
  MT_CHECK(c.rms_norm_eps > 0.0, "{}: rms_norm_eps must be positive but is {}", source, c.rms_norm_eps);

  c.num_key_value_heads = f.int_opt("num_key_value_heads").value_or(c.num_attention_heads);
  f.check_positive(c.num_key_value_heads, "num_key_value_heads");
  MT_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
           "{}: num_attention_heads ({}) is not divisible by num_key_value_heads ({})", source, c.num_attention_heads,
           c.num_key_value_heads);
  // transformers: head_dim = config.head_dim or hidden_size // num_attention_heads.
  c.head_dim = f.int_opt("head_dim").value_or(g.hidden_size / c.num_attention_heads);
  f.check_positive(c.head_dim, "head_dim");

  parse_rope(f, c);
  const double rotary = double(c.head_dim) * c.partial_rotary_factor;
  MT_CHECK(rotary == std::round(rotary) && rotary_dim(c) % 2 == 0,
           "{}: head_dim ({}) x partial_rotary_factor ({}) gives {} rotary dims; rope needs a whole, even number",
           source, c.head_dim, c.partial_rotary_factor, rotary);

  MT_CHECK(!f.bool_opt("attention_bias").value_or(false),
           "{}: attention_bias = true is not supported for qwen3 / qwen3_moe", source);
  MT_CHECK(!f.bool_opt("use_sliding_window").value_or(false),
           "{}: use_sliding_window = true is not supported for qwen3 / qwen3_moe", source);
  const std::string act = f.string_opt("hidden_act").value_or("silu");
  MT_CHECK(act == "silu", "{}: hidden_act '{}' is not supported for qwen3 / qwen3_moe (only 'silu')", source, act);
  c.max_position_embeddings = f.int_opt("max_position_embeddings").value_or(0);
  MT_CHECK(c.max_position_embeddings >= 0, "{}: max_position_embeddings must not be negative but is {}", source,
           c.max_position_embeddings);
}

json shared_fields_json(const ModelConfig& g, const Qwen3Config& c) {
  json j;
  j["vocab_size"] = g.vocab_size;
  j["hidden_size"] = g.hidden_size;
  j["num_hidden_layers"] = g.num_hidden_layers;
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
  j["tie_word_embeddings"] = g.tie_word_embeddings;
  // 0 means "not given": leave it out so transformers applies its own default.
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  j["dtype"] = "float32";
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
