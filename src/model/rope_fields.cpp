// defines: the rope fields' reader, and the YaRN fields' reader and writer.
#include "model/rope_fields.h"

#include <algorithm>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace moetrain::model {

RopeFields parse_rope_fields(const io::JsonFields& top, const std::string& family,
                             const std::vector<std::string>& rope_types) {
  const std::string& source = top.source();
  RopeFields r;
  r.rope_theta = top.number_opt("rope_theta");
  r.partial_rotary_factor = top.number_opt("partial_rotary_factor");
  // Where each value was first spelled, for the error that names two places.
  std::string theta_at = "at the top level", partial_at = "at the top level";
  const auto merge = [&](std::optional<double>& into, std::string& into_at, std::optional<double> value,
                         const char* name, const char* in) {
    if (!value) return;
    MT_CHECK(!into || *into == *value, "{}: {} is {} {} but {} in {}", source, name, *into, into_at, *value, in);
    if (!into) into_at = fmt::format("in {}", in);
    into = value;
  };
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    const std::optional<io::JsonFields> rope = top.object_opt(field);
    if (!rope) continue;
    r.any_rope_dict = true;
    // transformers reads rope_type, and the older key "type" only where rope_type is absent. A dict that spells both
    // differently describes two ropes: refused rather than read as one of them.
    const std::optional<std::string> rope_type = rope->string_opt("rope_type");
    const std::optional<std::string> legacy_type = rope->string_opt("type");
    MT_CHECK(!rope_type || !legacy_type || *rope_type == *legacy_type,
             "{}: {}.rope_type '{}' and {}.type '{}' disagree; keep one of them", source, field, *rope_type, field,
             *legacy_type);
    const char* key = rope_type ? "rope_type" : "type";
    const std::string type = rope_type ? *rope_type : legacy_type.value_or("default");
    MT_CHECK(std::find(rope_types.begin(), rope_types.end(), type) != rope_types.end(),
             "{}: {}.{} '{}' is not supported for {} (supported: {})", source, field, key, type, family,
             fmt::join(rope_types, ", "));
    if (type == "yarn") r.yarn = parse_yarn_fields(*rope, top, field);
    merge(r.rope_theta, theta_at, rope->number_opt("rope_theta"), "rope_theta", field);
    merge(r.partial_rotary_factor, partial_at, rope->number_opt("partial_rotary_factor"), "partial_rotary_factor",
          field);
  }
  MT_CHECK(!r.rope_theta || *r.rope_theta > 0.0, "{}: rope_theta must be positive but is {}", source, *r.rope_theta);
  MT_CHECK(!r.partial_rotary_factor || (*r.partial_rotary_factor > 0.0 && *r.partial_rotary_factor <= 1.0),
           "{}: partial_rotary_factor must be in (0, 1] but is {}", source, *r.partial_rotary_factor);
  return r;
}

void require_full_rotary(const RopeFields& rope, const std::string& source, const std::string& family) {
  MT_CHECK(rope.partial_rotary_factor.value_or(1.0) == 1.0,
           "{}: partial_rotary_factor {} is not supported for {} (only 1: its rope rotates every rotary dim)", source,
           *rope.partial_rotary_factor, family);
}

ops::YarnOptions parse_yarn_fields(const io::JsonFields& rope, const io::JsonFields& top, const std::string& field) {
  const std::string& source = rope.source();
  ops::YarnOptions y;
  const std::optional<int64_t> original = rope.int_opt("original_max_position_embeddings");
  MT_CHECK(original.has_value(), "{}: {}.original_max_position_embeddings is required for a yarn rope", source, field);
  y.original_max_position_embeddings = *original;
  if (const std::optional<double> factor = rope.number_opt("factor")) {
    y.factor = *factor;
  } else {
    const int64_t max_positions = top.int_opt("max_position_embeddings").value_or(0);
    MT_CHECK(max_positions > 0 && y.original_max_position_embeddings > 0,
             "{}: {}.factor is null and max_position_embeddings / original_max_position_embeddings cannot stand in",
             source, field);
    y.factor = double(max_positions) / double(y.original_max_position_embeddings);
  }
  const double beta_fast = rope.number_opt("beta_fast").value_or(0.0),
               beta_slow = rope.number_opt("beta_slow").value_or(0.0);
  if (beta_fast != 0.0) y.beta_fast = beta_fast;
  if (beta_slow != 0.0) y.beta_slow = beta_slow;
  y.mscale = rope.number_opt("mscale").value_or(0.0);
  y.mscale_all_dim = rope.number_opt("mscale_all_dim").value_or(0.0);
  y.attention_factor = rope.number_opt("attention_factor");
  y.truncate = rope.bool_opt("truncate").value_or(true);
  return y;
}

void add_yarn_fields(nlohmann::json& rope, const ops::YarnOptions& yarn) {
  rope["factor"] = yarn.factor;
  rope["original_max_position_embeddings"] = yarn.original_max_position_embeddings;
  rope["beta_fast"] = yarn.beta_fast;
  rope["beta_slow"] = yarn.beta_slow;
  // 0 means absent (transformers tests them for truthiness): written only when set, so an export spells the rope as
  // its source did.
  if (yarn.mscale != 0.0) rope["mscale"] = yarn.mscale;
  if (yarn.mscale_all_dim != 0.0) rope["mscale_all_dim"] = yarn.mscale_all_dim;
  if (yarn.attention_factor) rope["attention_factor"] = *yarn.attention_factor;
  rope["truncate"] = yarn.truncate;
}

}  // namespace moetrain::model
