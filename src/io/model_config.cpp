// defines: the config.json parser and writer of model_config.h. Every field is read through one
// typed getter that names the field and the file when it is missing or of the wrong JSON type.
#include "io/model_config.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain::io {

namespace {

using nlohmann::json;

constexpr const char* kSupportedTypes = "qwen3, qwen3_moe";

std::string found_str(const json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return fmt::format("{} ({})", value.type_name(), text);
}

// Reads one field of a JSON object with a type check; `where` names the object ("" for the top
// level, "rope_parameters." for a nested one). A null value counts as absent.
class FieldReader {
 public:
  FieldReader(const json& object, std::string source, std::string where = "")
      : object_(object), source_(std::move(source)), where_(std::move(where)) {}

  bool has(const char* name) const {
    const auto it = object_.find(name);
    return it != object_.end() && !it->is_null();
  }

  std::optional<int64_t> int_opt(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = object_.at(name);
    MT_CHECK(v.is_number_integer(), "{}: field '{}{}' must be an integer but found {}", source_, where_, name,
             found_str(v));
    MT_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
             "{}: field '{}{}' is too large ({})", source_, where_, name, v.dump());
    return v.get<int64_t>();
  }
  std::optional<double> number_opt(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = object_.at(name);
    MT_CHECK(v.is_number(), "{}: field '{}{}' must be a number but found {}", source_, where_, name, found_str(v));
    return v.get<double>();
  }
  std::optional<bool> bool_opt(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = object_.at(name);
    MT_CHECK(v.is_boolean(), "{}: field '{}{}' must be true or false but found {}", source_, where_, name,
             found_str(v));
    return v.get<bool>();
  }
  std::optional<std::string> string_opt(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = object_.at(name);
    MT_CHECK(v.is_string(), "{}: field '{}{}' must be a string but found {}", source_, where_, name, found_str(v));
    return v.get<std::string>();
  }
  std::optional<std::vector<int64_t>> int_list_opt(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = object_.at(name);
    MT_CHECK(v.is_array(), "{}: field '{}{}' must be a list of integers but found {}", source_, where_, name,
             found_str(v));
    std::vector<int64_t> out;
    for (const json& e : v) {
      MT_CHECK(e.is_number_integer(), "{}: field '{}{}' must be a list of integers but holds {}", source_, where_, name,
               found_str(e));
      out.push_back(e.get<int64_t>());
    }
    return out;
  }

  int64_t require_int(const char* name) const {
    require_present(name);
    return *int_opt(name);
  }
  double require_number(const char* name) const {
    require_present(name);
    return *number_opt(name);
  }
  std::string require_string(const char* name) const {
    require_present(name);
    return *string_opt(name);
  }

 private:
  void require_present(const char* name) const {
    const auto it = object_.find(name);
    MT_CHECK(it != object_.end(), "{}: required field '{}{}' is missing", source_, where_, name);
    MT_CHECK(!it->is_null(), "{}: required field '{}{}' is null", source_, where_, name);
  }

  const json& object_;
  std::string source_;
  std::string where_;
};

void check_positive(int64_t value, const char* name, const std::string& source) {
  MT_CHECK(value > 0, "{}: {} must be positive but is {}", source, name, value);
}

// Checks a rope_type: these families only have the plain (unscaled) rotary embedding.
void check_rope_type(const std::string& rope_type, const char* field, const std::string& source) {
  MT_CHECK(rope_type == "default",
           "{}: {} '{}' is not supported for qwen3 / qwen3_moe (only 'default', no rope scaling)", source, field,
           rope_type);
}

// rope_theta and partial_rotary_factor: transformers 5 keeps them in rope_parameters, older
// versions at the top level next to rope_scaling (null for no scaling). Both are accepted; when
// both spell a value they must agree.
void parse_rope(const json& root, const FieldReader& top, const std::string& source, ModelConfig& c) {
  std::optional<double> theta = top.number_opt("rope_theta");
  std::optional<double> partial = top.number_opt("partial_rotary_factor");

  const auto merge = [&](std::optional<double>& into, std::optional<double> value, const char* name) {
    if (!value) return;
    MT_CHECK(!into || *into == *value, "{}: {} is {} at the top level but {} in rope_parameters", source, name, *into,
             *value);
    into = value;
  };

  if (top.has("rope_parameters")) {
    const json& rp = root.at("rope_parameters");
    MT_CHECK(rp.is_object(), "{}: field 'rope_parameters' must be an object but found {}", source, found_str(rp));
    const FieldReader rope(rp, source, "rope_parameters.");
    if (auto type = rope.string_opt("rope_type")) check_rope_type(*type, "rope_parameters.rope_type", source);
    if (auto type = rope.string_opt("type")) check_rope_type(*type, "rope_parameters.type", source);
    merge(theta, rope.number_opt("rope_theta"), "rope_theta");
    merge(partial, rope.number_opt("partial_rotary_factor"), "partial_rotary_factor");
  }
  if (top.has("rope_scaling")) {
    const json& rs = root.at("rope_scaling");
    MT_CHECK(rs.is_object(), "{}: field 'rope_scaling' must be null or an object but found {}", source, found_str(rs));
    const FieldReader scaling(rs, source, "rope_scaling.");
    if (auto type = scaling.string_opt("rope_type")) check_rope_type(*type, "rope_scaling.rope_type", source);
    if (auto type = scaling.string_opt("type")) check_rope_type(*type, "rope_scaling.type", source);
  }
  if (theta) c.rope_theta = *theta;
  if (partial) c.partial_rotary_factor = *partial;
}

void parse_moe(const FieldReader& f, const std::string& source, ModelConfig& c) {
  const std::optional<int64_t> experts = f.int_opt("num_experts");
  const std::optional<int64_t> local_experts = f.int_opt("num_local_experts");
  MT_CHECK(experts || local_experts, "{}: required field 'num_experts' (or 'num_local_experts') is missing", source);
  MT_CHECK(!experts || !local_experts || *experts == *local_experts,
           "{}: num_experts ({}) and num_local_experts ({}) disagree; keep one of them", source, experts.value_or(0),
           local_experts.value_or(0));
  c.num_experts = experts ? *experts : *local_experts;
  c.num_experts_per_tok = f.require_int("num_experts_per_tok");
  c.moe_intermediate_size = f.require_int("moe_intermediate_size");
  c.norm_topk_prob = f.bool_opt("norm_topk_prob").value_or(false);
  c.decoder_sparse_step = f.int_opt("decoder_sparse_step").value_or(1);
  c.mlp_only_layers = f.int_list_opt("mlp_only_layers").value_or(std::vector<int64_t>{});
  c.router_aux_loss_coef = f.number_opt("router_aux_loss_coef").value_or(0.0);

  check_positive(c.num_experts, "num_experts", source);
  check_positive(c.num_experts_per_tok, "num_experts_per_tok", source);
  check_positive(c.moe_intermediate_size, "moe_intermediate_size", source);
  check_positive(c.decoder_sparse_step, "decoder_sparse_step", source);
  MT_CHECK(c.num_experts_per_tok <= c.num_experts, "{}: num_experts_per_tok ({}) exceeds num_experts ({})", source,
           c.num_experts_per_tok, c.num_experts);
  for (int64_t layer : c.mlp_only_layers) {
    MT_CHECK(layer >= 0 && layer < c.num_hidden_layers,
             "{}: mlp_only_layers entry {} is outside [0, num_hidden_layers = {})", source, layer, c.num_hidden_layers);
  }
}

}  // namespace

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (family != ModelFamily::Qwen3Moe || num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    MT_FAIL("{}: not valid JSON at byte {}: {}", source, e.byte, e.what());
  }
  MT_CHECK(root.is_object(), "{}: expected a JSON object at the top level but found {}", source, found_str(root));
  const FieldReader f(root, source);

  ModelConfig c;
  c.model_type = f.require_string("model_type");
  if (c.model_type == "qwen3") {
    c.family = ModelFamily::Qwen3;
  } else if (c.model_type == "qwen3_moe") {
    c.family = ModelFamily::Qwen3Moe;
  } else {
    MT_FAIL("{}: model_type '{}' is not supported (supported: {})", source, c.model_type, kSupportedTypes);
  }

  c.vocab_size = f.require_int("vocab_size");
  c.hidden_size = f.require_int("hidden_size");
  c.num_hidden_layers = f.require_int("num_hidden_layers");
  c.num_attention_heads = f.require_int("num_attention_heads");
  c.intermediate_size = f.require_int("intermediate_size");
  c.rms_norm_eps = f.require_number("rms_norm_eps");
  check_positive(c.vocab_size, "vocab_size", source);
  check_positive(c.hidden_size, "hidden_size", source);
  check_positive(c.num_hidden_layers, "num_hidden_layers", source);
  check_positive(c.num_attention_heads, "num_attention_heads", source);
  check_positive(c.intermediate_size, "intermediate_size", source);
  MT_CHECK(c.rms_norm_eps > 0.0, "{}: rms_norm_eps must be positive but is {}", source, c.rms_norm_eps);

  c.num_key_value_heads = f.int_opt("num_key_value_heads").value_or(c.num_attention_heads);
  check_positive(c.num_key_value_heads, "num_key_value_heads", source);
  MT_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
           "{}: num_attention_heads ({}) is not divisible by num_key_value_heads ({})", source, c.num_attention_heads,
           c.num_key_value_heads);
  // transformers: head_dim = config.head_dim or hidden_size // num_attention_heads.
  c.head_dim = f.int_opt("head_dim").value_or(c.hidden_size / c.num_attention_heads);
  check_positive(c.head_dim, "head_dim", source);

  parse_rope(root, f, source, c);
  MT_CHECK(c.rope_theta > 0.0, "{}: rope_theta must be positive but is {}", source, c.rope_theta);
  MT_CHECK(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0,
           "{}: partial_rotary_factor must be in (0, 1] but is {}", source, c.partial_rotary_factor);

  c.attention_bias = f.bool_opt("attention_bias").value_or(false);
  c.tie_word_embeddings = f.bool_opt("tie_word_embeddings").value_or(false);
  c.max_position_embeddings = f.int_opt("max_position_embeddings").value_or(0);
  MT_CHECK(c.max_position_embeddings >= 0, "{}: max_position_embeddings must not be negative but is {}", source,
           c.max_position_embeddings);

  if (c.family == ModelFamily::Qwen3Moe) parse_moe(f, source, c);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::filesystem::path file(path);
  if (std::filesystem::is_directory(file)) file /= "config.json";
  std::ifstream in(file, std::ios::binary);
  MT_CHECK(in.good(), "{}: cannot open the model config (expected a config.json file or a folder holding one)",
           file.string());
  std::ostringstream text;
  text << in.rdbuf();
  MT_CHECK(!in.bad(), "{}: read failed", file.string());
  return parse_model_config(text.str(), file.string());
}

std::string model_config_to_json(const ModelConfig& c) {
  const bool moe = c.family == ModelFamily::Qwen3Moe;
  json j;
  j["architectures"] = json::array({moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"});
  j["model_type"] = moe ? "qwen3_moe" : "qwen3";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  json rope = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  if (c.partial_rotary_factor != 1.0) rope["partial_rotary_factor"] = c.partial_rotary_factor;
  j["rope_parameters"] = rope;
  j["attention_bias"] = c.attention_bias;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  // 0 means "not given": leave it out so transformers applies its own default.
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  if (moe) {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
  j["dtype"] = "float32";
  return j.dump(2) + "\n";
}

}  // namespace moetrain::io
