// defines: ModelConfig's layer queries, the fields several families read alike, and the config.json reader and
// writer, which hand the file to its family.
#include "model/model_config.h"

#include <filesystem>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "io/json_fields.h"
#include "model/family.h"

namespace moetrain::model {

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (bool moe : moe_layers) n += moe ? 1 : 0;
  return n;
}

int64_t ModelConfig::moe_index(int64_t layer) const {
  if (!layer_is_moe(layer)) return -1;
  int64_t index = 0;
  for (int64_t l = 0; l < layer; ++l) index += layer_is_moe(l) ? 1 : 0;
  return index;
}

void parse_model_shape(const io::JsonFields& f, ModelConfig& g) {
  g.vocab_size = f.require_int("vocab_size");
  g.hidden_size = f.require_int("hidden_size");
  g.num_hidden_layers = f.require_int("num_hidden_layers");
  f.check_positive(g.vocab_size, "vocab_size");
  f.check_positive(g.hidden_size, "hidden_size");
  f.check_positive(g.num_hidden_layers, "num_hidden_layers", kMaxLayers);
  g.tie_word_embeddings = f.bool_opt("tie_word_embeddings").value_or(false);
}

nlohmann::json model_shape_json(const ModelConfig& g) {
  nlohmann::json j;
  j["vocab_size"] = g.vocab_size;
  j["hidden_size"] = g.hidden_size;
  j["num_hidden_layers"] = g.num_hidden_layers;
  j["tie_word_embeddings"] = g.tie_word_embeddings;
  j["dtype"] = "float32";
  return j;
}

int64_t parse_max_position_embeddings(const io::JsonFields& f) {
  const int64_t positions = f.int_opt("max_position_embeddings").value_or(0);
  MT_CHECK(positions >= 0, "{}: max_position_embeddings must not be negative but is {}", f.source(), positions);
  return positions;
}

void require_silu_activation(const io::JsonFields& f, const std::string& family) {
  const std::string act = f.string_opt("hidden_act").value_or("silu");
  MT_CHECK(act == "silu", "{}: hidden_act '{}' is not supported for {} (only 'silu')", f.source(), act, family);
}

double parse_rms_norm_eps(const io::JsonFields& f, std::optional<double> default_eps) {
  const double eps =
      default_eps ? f.number_opt("rms_norm_eps").value_or(*default_eps) : f.require_number("rms_norm_eps");
  MT_CHECK(eps > 0.0, "{}: rms_norm_eps must be positive but is {}", f.source(), eps);
  return eps;
}

AttentionHeads parse_attention_heads(const io::JsonFields& f, int64_t hidden_size) {
  AttentionHeads heads;
  heads.num_attention_heads = f.require_int("num_attention_heads");
  f.check_positive(heads.num_attention_heads, "num_attention_heads");
  heads.num_key_value_heads = f.int_opt("num_key_value_heads").value_or(heads.num_attention_heads);
  f.check_positive(heads.num_key_value_heads, "num_key_value_heads");
  MT_CHECK(heads.num_attention_heads % heads.num_key_value_heads == 0,
           "{}: num_attention_heads ({}) is not divisible by num_key_value_heads ({})", f.source(),
           heads.num_attention_heads, heads.num_key_value_heads);
  heads.head_dim = f.int_opt("head_dim").value_or(hidden_size / heads.num_attention_heads);
  f.check_positive(heads.head_dim, "head_dim");
  return heads;
}

namespace {

ModelConfig config_from_json(const nlohmann::json& root, const std::string& source, bool nested = false) {
  const io::JsonFields fields(root, source);
  const std::string model_type = fields.require_string("model_type");
  const Family& family = family_for(model_type, source);
  const Family::NestedConfig wrapped = family.nested_config(model_type);
  if (!wrapped.key.empty()) {
    MT_CHECK(!nested, "{}: model_type '{}' wraps its model in '{}', but it is itself the wrapped config", source,
             model_type, wrapped.key);
    const std::optional<io::JsonFields> inner = fields.object_opt(wrapped.key.c_str());
    MT_CHECK(inner.has_value(), "{}: model_type '{}' keeps the model's config in the object '{}', which is missing",
             source, model_type, wrapped.key);
    // Read through the checked reader: a wrapped model_type of another type than a string is refused by name.
    const std::string inner_type = inner->string_opt("model_type").value_or(wrapped.model_type);
    std::vector<std::string> left_out;
    for (const auto& [key, value] : root.items())
      if (value.is_object() && key != wrapped.key) left_out.push_back(key);
    log_info("{}: model_type '{}': training the model of its '{}' ({}); left out: {}", source, model_type, wrapped.key,
             inner_type, left_out.empty() ? std::string("nothing else") : fmt::format("{}", fmt::join(left_out, ", ")));
    nlohmann::json text = root.at(wrapped.key);
    if (!text.contains("model_type") || text.at("model_type").is_null()) text["model_type"] = wrapped.model_type;
    return config_from_json(text, source + ": " + wrapped.key, true);
  }
  ModelConfig config = family.parse_config(fields);
  config.family = &family;
  config.model_type = model_type;
  config.source = source;
  config.hf_source_json = root.dump();
  MT_CHECK(static_cast<int64_t>(config.moe_layers.size()) == config.num_hidden_layers,
           "{}: family '{}' described {} layers' routing for {} decoder layers", source, family.name(),
           config.moe_layers.size(), config.num_hidden_layers);
  return config;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  return config_from_json(io::parse_json_object(json_text, source), source);
}

ModelConfig load_model_config(const std::string& path) {
  std::filesystem::path file(path);
  if (std::filesystem::is_directory(file)) file /= "config.json";
  std::error_code ec;
  MT_CHECK(std::filesystem::exists(file, ec),
           "{}: cannot open the model config (expected a config.json file or a folder holding one)", file.string());
  return config_from_json(io::read_json_object(file.string()), file.string());
}

namespace {

// Source fields an export must not carry over: the export is a float checkpoint (never quantised), and the family's
// rope_parameters supersede the legacy spellings transformers 4 configs use (rope_scaling, a top-level rope_theta),
// which transformers 5 would otherwise read as a second description of the rope.
bool superseded_on_export(const std::string& key, const nlohmann::json& written) {
  if (key == "quantization_config") return true;
  return written.contains("rope_parameters") && (key == "rope_scaling" || key == "rope_theta");
}

}  // namespace

std::string model_config_to_json(const ModelConfig& config) {
  MT_CHECK(config.family != nullptr, "model config of '{}' has no family", config.model_type);
  const std::string written = config.family->to_hf_config_json(config);
  if (config.hf_source_json.empty()) return written;
  nlohmann::json out = io::parse_json_object(written, "the family's config.json");
  const nlohmann::json source = io::parse_json_object(config.hf_source_json, config.source);
  for (const auto& [key, value] : source.items()) {
    if (out.contains(key) || superseded_on_export(key, out)) continue;
    out[key] = value;
  }
  return out.dump(2) + "\n";
}

}  // namespace moetrain::model
