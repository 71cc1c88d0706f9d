// defines: the Qwen3 (dense) family: model_type "qwen3", as transformers 5.17's Qwen3Config and Qwen3ForCausalLM.
#pragma once

#include "model/family.h"

namespace moetrain::model::families::qwen3 {

const Family& family();

}  // namespace moetrain::model::families::qwen3
