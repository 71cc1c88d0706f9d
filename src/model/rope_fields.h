// defines: the YaRN fields of a config.json's rope parameters, read and written as transformers 5.17 does
// (_compute_yarn_parameters), for every family whose rope may be YaRN (DeepSeek-V2, GPT-OSS): one reader, so a
// field means the same thing in every family.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "ops/rope.h"

namespace moetrain::model {

// The YaRN options of `rope` (the rope_parameters / rope_scaling object named `field` of the config `top`):
// original_max_position_embeddings (required); factor (null: max_position_embeddings / the original); beta_fast,
// beta_slow (0 or null: their defaults); mscale, mscale_all_dim, attention_factor; truncate (default true).
ops::YarnOptions parse_yarn_fields(const io::JsonFields& rope, const io::JsonFields& top, const std::string& field);
// Adds the YaRN fields of `yarn` to `rope` ("rope_type" is the caller's).
void add_yarn_fields(nlohmann::json& rope, const ops::YarnOptions& yarn);

}  // namespace moetrain::model
