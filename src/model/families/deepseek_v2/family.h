// defines: the DeepSeek-V2 family: model_type "deepseek_v2", as transformers 5.17's DeepseekV2Config and
// DeepseekV2ForCausalLM (DeepSeek-V2 and DeepSeek-V2-Lite): multi-head latent attention, the first
// first_k_dense_replace layers dense, then routed experts with softmax scores, greedy or group-limited top-k, a routed
// scaling factor, and shared experts added to every token.
#pragma once

#include "model/family.h"

namespace moetrain::model::families::deepseek_v2 {

const Family& family();

}  // namespace moetrain::model::families::deepseek_v2
