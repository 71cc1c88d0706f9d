// defines: the Qwen3-MoE family: model_type "qwen3_moe", as transformers 5.17's Qwen3MoeConfig and
// Qwen3MoeForCausalLM (Qwen3's attention; routed SwiGLU experts with softmax top-k, dense layers where
// mlp_only_layers or decoder_sparse_step say).
#pragma once

#include "model/family.h"

namespace moetrain::model::families::qwen3_moe {

const Family& family();

}  // namespace moetrain::model::families::qwen3_moe
