// defines: the Qwen3.5 family: model_type "qwen3_5_text" (dense) and "qwen3_5_moe_text" (MoE), as transformers 5.17's
// Qwen3_5TextConfig / Qwen3_5ForCausalLM and Qwen3_5MoeTextConfig / Qwen3_5MoeForCausalLM: Gated DeltaNet layers and
// full-attention layers (an output gate, partial rotary, q/k norm) as layer_types says, zero-centred RMSNorms (1 + w),
// and a dense SwiGLU MLP or, in every MoE layer, softmax top-k routing (renormalised) over SwiGLU experts with a
// sigmoid-gated shared expert. The multimodal "qwen3_5" and "qwen3_5_moe" train their text_config; their vision tower
// is left out.
#pragma once

#include "model/family.h"

namespace moetrain::model::families::qwen3_5 {

const Family& family();

}  // namespace moetrain::model::families::qwen3_5
