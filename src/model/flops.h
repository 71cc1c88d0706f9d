// defines: the model FLOPs of training one token (forward + backward), the one formula that the trainer's MFU,
// the benchmarks and the pipeline partition's cost model share: 6 x the matmul weights a token touches (2 forward,
// 4 backward) plus 3 x the attention core's forward FLOPs, each layer's terms from its family (Family::layer_flops).
#pragma once

#include <cstdint>

#include "model/model_config.h"

namespace moetrain::model {

// Decoder layer `layer`, with attention over `context` tokens.
double layer_training_flops(const ModelConfig& config, int64_t layer, int64_t context);
// The LM head (an H x V matmul) with the loss; the embedding lookup costs ~0.
double head_training_flops(const ModelConfig& config);
// The whole model at sequence length `seq_len`.
double training_flops_per_token(const ModelConfig& config, int64_t seq_len);

}  // namespace moetrain::model
