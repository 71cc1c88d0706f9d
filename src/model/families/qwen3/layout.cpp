// defines: the Qwen3 / Qwen3-MoE HF names of every parameter (layout.h).
#include "model/families/qwen3/layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::model::families::qwen3 {

std::string layer_prefix(int64_t layer) { return fmt::format("layers.{}.", layer); }

void attach_layer_pieces(std::vector<ParamSpec>& specs, int64_t layer) {
  const std::string prefix = layer_prefix(layer);
  const std::string hf = fmt::format("model.layers.{}.", layer);
  for (ParamSpec& spec : specs) {
    MT_CHECK(spec.name.rfind(prefix, 0) == 0 && spec.pieces.empty(),
             "qwen3 layout: parameter '{}' is not a fresh parameter of layer {}", spec.name, layer);
    const std::string local = spec.name.substr(prefix.size());
    const auto whole = [&](const std::string& hf_name) {
      spec.pieces.push_back({hf + hf_name, spec.shape, 0, {}, {}});
    };
    if (local == "input_norm") {
      whole("input_layernorm.weight");
    } else if (local == "post_norm") {
      whole("post_attention_layernorm.weight");
    } else if (local.rfind("attn.", 0) == 0) {
      whole("self_attn." + local.substr(5) + ".weight");  // q_proj, k_proj, v_proj, o_proj, q_norm, k_norm
    } else if (local == "router") {
      whole("mlp.gate.weight");
    } else if (local == "mlp.gate_up" || local == "experts.gate_up") {
      attach_hf_mlp_pieces(spec, hf + "mlp.", local == "experts.gate_up", true);
    } else if (local == "mlp.down" || local == "experts.down") {
      attach_hf_mlp_pieces(spec, hf + "mlp.", local == "experts.down", false);
    } else {
      MT_FAIL("qwen3 layout: no HF name for parameter '{}'", spec.name);
    }
  }
}

std::vector<ParamSpec> model_param_specs(const ModelConfig& g, const Qwen3Config& c,
                                         const std::function<PreNormLayerOptions(int64_t)>& options) {
  return decoder_model_specs(g, [&](int64_t layer) {
    const std::string prefix = layer_prefix(layer);
    std::vector<ParamSpec> specs = PreNormLayer::param_specs(
        options(layer), GqaAttention::param_specs(attention_options(g, c), prefix + "attn.", layer), prefix);
    attach_layer_pieces(specs, layer);
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
