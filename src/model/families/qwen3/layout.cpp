// defines: the Qwen3 / Qwen3-MoE HF names of every parameter (layout.h).
#include "model/families/qwen3/layout.h"

namespace moetrain::model::families::qwen3 {

std::vector<ParamSpec> model_param_specs(const ModelConfig& g, const Qwen3Config& c,
                                         const std::function<PreNormLayerOptions(int64_t)>& options) {
  return decoder_model_specs(g, [&](int64_t layer) {
    const std::string prefix = layer_prefix(layer);
    std::vector<ParamSpec> specs = PreNormLayer::param_specs(
        options(layer), GqaAttention::param_specs(attention_options(g, c), prefix + "attn.", layer), prefix);
    attach_layer_pieces(specs, layer, "qwen3", nullptr);  // every name is a shared one
    return specs;
  });
}

std::unique_ptr<DecoderLayer> make_pre_norm_layer(const ModelConfig& g, const Qwen3Config& c, ParameterStore& store,
                                                  const PreNormLayerOptions& options) {
  const std::string prefix = layer_prefix(options.layer);
  auto attention = std::make_unique<GqaAttention>(attention_options(g, c), store, prefix + "attn.");
  return std::make_unique<PreNormLayer>(options, std::move(attention), store, prefix);
}

LayerActivationShape attention_activation_shape(const Qwen3Config& c) {
  LayerActivationShape s;
  s.heads = c.num_attention_heads;
  s.kv_heads = c.num_key_value_heads;
  s.q_cols = c.num_attention_heads * c.head_dim;
  s.kv_cols = c.num_key_value_heads * c.head_dim;
  s.qk_norm = true;
  return s;
}

LayerFlops attention_flops(const ModelConfig& g, const Qwen3Config& c, int64_t context) {
  const double h = double(g.hidden_size), hd = double(c.head_dim);
  const double nh = double(c.num_attention_heads), nkv = double(c.num_key_value_heads);
  LayerFlops f;
  f.matmul_weights = h * (nh + 2 * nkv) * hd + nh * hd * h;  // q, k, v, o projections
  f.attention_core = 4 * (double(context) / 2) * nh * hd;    // causal: a token sees half the context on average
  return f;
}

}  // namespace moetrain::model::families::qwen3
