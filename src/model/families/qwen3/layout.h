// defines: the Qwen3 HF adapter: transformers' tensor names for the engine's parameters of a Qwen3 or Qwen3-MoE
// model (the embedding, each decoder layer's norms, attention, dense MLP or router and experts, the final norm, the
// head), as HF pieces on the specs the blocks declare. Gate and up projections are fused into one [2I, H] weight
// (gate rows first); experts are stacked into [E, ...], and transformers' in-memory names for the fused expert
// tensors are kept as hf_fused_name.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/blocks/pre_norm_layer.h"
#include "model/families/qwen3/config.h"
#include "model/family.h"
#include "model/parameter_store.h"
#include "model/pre_norm_decoder.h"

namespace moetrain::model::families::qwen3 {

// Every parameter of a Qwen3 or Qwen3-MoE model in order (embedding, layers, final norm, head), each layer's from
// `options(layer)` and the attention block, with their HF pieces.
std::vector<ParamSpec> model_param_specs(const ModelConfig& generic, const Qwen3Config& own,
                                         const std::function<PreNormLayerOptions(int64_t)>& options);
// Decoder layer `layer` of such a model: the pre-norm layer of `options` around GQA attention.
std::unique_ptr<DecoderLayer> make_pre_norm_layer(const ModelConfig& generic, const Qwen3Config& own,
                                                  ParameterStore& store, const PreNormLayerOptions& options);
// The attention part of a layer's FLOPs (projections and the core at `context`).
LayerFlops attention_flops(const ModelConfig& generic, const Qwen3Config& own, int64_t context);
// The attention part of a layer's activation shape (GQA with q/k norm); `width` and `moe` are the caller's.
LayerActivationShape attention_activation_shape(const Qwen3Config& own);

}  // namespace moetrain::model::families::qwen3
