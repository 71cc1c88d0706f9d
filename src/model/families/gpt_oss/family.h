// defines: the GPT-OSS family: model_type "gpt_oss", as transformers 5.17's GptOssConfig and GptOssForCausalLM
// (gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases, a learned sink logit per head and a sliding
// window on alternate layers, YaRN rope, and in every layer a biased router (top-k over the logits, then a softmax
// over the k kept) over experts with biases and the clamped SwiGLU. MXFP4 checkpoints are dequantised on load.
#pragma once

#include "model/family.h"

namespace moetrain::model::families::gpt_oss {

const Family& family();

}  // namespace moetrain::model::families::gpt_oss
