// defines: the YaRN rope fields' reader and writer.
#include "model/rope_fields.h"

#include <optional>

#include "core/error.h"

namespace moetrain::model {

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
