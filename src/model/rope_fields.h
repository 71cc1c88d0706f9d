// defines: the rope fields of a config.json, read once for every family: where transformers 5 and its older
// versions spell the rope (rope_parameters, or rope_scaling beside a top-level rope_theta), which rope types a family
// accepts, and the YaRN fields, read and written as transformers 5.17 does (_compute_yarn_parameters) for every
// family whose rope may be YaRN (DeepSeek-V2, GPT-OSS). One reader, so a field means the same thing in every family.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_fields.h"
#include "ops/rope.h"

namespace moetrain::model {

// The rope a config.json spells, in any of its places: rope_parameters (transformers 5) and rope_scaling (older
// versions, null for no scaling), with rope_theta and partial_rotary_factor inside them or at the top level. Unset
// where the config does not spell it: the family applies its own default.
struct RopeFields {
  std::optional<double> rope_theta;
  std::optional<double> partial_rotary_factor;
  std::optional<ops::YarnOptions> yarn;  // a dict whose rope_type is "yarn"
  bool any_rope_dict = false;            // rope_parameters or rope_scaling is present
};

// Reads the rope of the config `top`. Each dict's rope_type (or, where it is absent, its older key "type"; neither:
// "default") must be one of `rope_types` ("default", and "yarn" for a family that reads YaRN), or it is refused naming
// the field and `family`; a dict whose rope_type and type disagree is refused. A value spelled in more than one place
// must be the same in each; rope_theta must be positive and partial_rotary_factor in (0, 1].
RopeFields parse_rope_fields(const io::JsonFields& top, const std::string& family,
                             const std::vector<std::string>& rope_types);
// Refuses a partial_rotary_factor other than 1 (transformers would rotate only part of the rotary dims) for a family
// whose rope always rotates all of them.
void require_full_rotary(const RopeFields& rope, const std::string& source, const std::string& family);

// The YaRN options of `rope` (the rope_parameters / rope_scaling object named `field` of the config `top`):
// original_max_position_embeddings (required); factor (null: max_position_embeddings / the original); beta_fast,
// beta_slow (0 or null: their defaults); mscale, mscale_all_dim, attention_factor; truncate (default true).
ops::YarnOptions parse_yarn_fields(const io::JsonFields& rope, const io::JsonFields& top, const std::string& field);
// Adds the YaRN fields of `yarn` to `rope` ("rope_type" is the caller's).
void add_yarn_fields(nlohmann::json& rope, const ops::YarnOptions& yarn);

}  // namespace moetrain::model
