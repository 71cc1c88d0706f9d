// defines: the training FLOPs per token of a layer, the head and the whole model.
#include "model/flops.h"

#include "model/family.h"

namespace moetrain::model {

double layer_training_flops(const ModelConfig& config, int64_t layer, int64_t context) {
  MT_CHECK(config.family != nullptr, "flops: model config of '{}' has no family", config.model_type);
  const LayerFlops f = config.family->layer_flops(config, layer, context);
  return 6 * f.matmul_weights + 3 * f.attention_core;
}

double head_training_flops(const ModelConfig& config) {
  return 6 * double(config.hidden_size) * double(config.vocab_size);
}

double training_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  double total = head_training_flops(config);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    total += layer_training_flops(config, layer, seq_len);
  return total;
}

}  // namespace moetrain::model
