// defines: the GPT-OSS family: config.json's "gpt_oss", its parameters and HF names (the experts' [E, H, 2I] gate_up
// with alternating gate and up columns, read through strided pieces), its layers, FLOPs and certification.
#include "model/families/gpt_oss/family.h"

#include <nlohmann/json.hpp>

#include "model/blocks/attention.h"
#include "model/blocks/pre_norm_layer.h"
#include "model/families/gpt_oss/config.h"
#include "model/pre_norm_decoder.h"

namespace moetrain::model::families::gpt_oss {

namespace {

AttentionOptions attention_options(const ModelConfig& g, const GptOssConfig& c, int64_t layer) {
  AttentionOptions o;
  o.hidden_size = g.hidden_size;
  o.num_heads = c.num_attention_heads;
  o.num_kv_heads = c.num_key_value_heads;
  o.head_dim = c.head_dim;
  const int rotary = static_cast<int>(c.head_dim);
  // YaRN's attention factor multiplies cos and sin (RopeParams::attention_scaling); the softmax scale stays
  // 1 / sqrt(head_dim), as GptOssAttention.scaling.
  o.rope =
      c.yarn ? ops::rope_yarn_params(rotary, c.rope_theta, *c.yarn) : ops::rope_default_params(rotary, c.rope_theta);
  o.qkv_bias = c.attention_bias;
  o.output_bias = c.attention_bias;
  o.sinks = true;
  o.sliding_window = c.sliding_layers[static_cast<size_t>(layer)] ? c.sliding_window : 0;
  return o;
}

PreNormLayerOptions layer_options(const ModelConfig& g, const GptOssConfig& c, int64_t layer) {
  PreNormLayerOptions o = pre_norm_layer_options(g, layer, rms_norm_params(c.rms_norm_eps));
  MoeOptions moe = routed_experts_options(g, c.intermediate_size, false);
  moe.router.topk_before_softmax = true;
  moe.router.bias = true;
  moe.experts.activation = GatedActivation::ClampedSwiGlu;
  moe.experts.swiglu_alpha = kSwigluAlpha;
  moe.experts.swiglu_limit = kSwigluLimit;
  moe.experts.bias = true;
  o.moe = moe;
  return o;
}

// transformers' names for the parameters of a decoder layer that are GPT-OSS's own (pre_norm_decoder.h has the
// rest). The experts are stored [E, in, out] (x @ W) with gate_up's columns alternating gate (even) and up (odd);
// internally gate_up is [E, 2I, H], gate rows first.
bool attach_own_name(const LayerParam& p, const ModelConfig& g, const GptOssConfig& c) {
  const std::string& local = p.local;
  const std::string& hf = p.hf_prefix;
  const int64_t e = g.num_experts, h = g.hidden_size, i = c.intermediate_size;
  if (local == "attn.q_bias" || local == "attn.k_bias" || local == "attn.v_bias" || local == "attn.o_bias") {
    p.whole("self_attn." + local.substr(5, 1) + "_proj.bias");
  } else if (local == "attn.sinks") {
    p.whole("self_attn.sinks");
  } else if (local == "router") {
    p.whole("mlp.router.weight");
  } else if (local == "router_bias") {
    p.whole("mlp.router.bias");
  } else if (local == "experts.gate_up") {
    // HF (e, h, 2j + p) -> internal (e, p * I + j, h): p = 0 gate, 1 up.
    p.spec.pieces.push_back(
        strided_piece(hf + "mlp.experts.gate_up_proj", {e, h, 2 * i}, 0, {e, h, i, 2}, {2 * i * h, 1, h, i * h}));
    p.spec.pieces.back().mxfp4_transposed = true;  // released checkpoints: gate_up_proj_blocks [E, 2I, H / 32, 16]
  } else if (local == "experts.gate_up_bias") {
    p.spec.pieces.push_back(
        strided_piece(hf + "mlp.experts.gate_up_proj_bias", {e, 2 * i}, 0, {e, i, 2}, {2 * i, 1, i}));
  } else if (local == "experts.down") {
    // HF (e, j, h) -> internal (e, h, j).
    p.spec.pieces.push_back(strided_piece(hf + "mlp.experts.down_proj", {e, i, h}, 0, {e, i, h}, {h * i, 1, i}));
    p.spec.pieces.back().mxfp4_transposed = true;  // down_proj_blocks [E, H, I / 32, 16]
  } else if (local == "experts.down_bias") {
    p.whole("mlp.experts.down_proj_bias");
  } else {
    return false;
  }
  return true;
}

class GptOssFamily final : public Family {
 public:
  std::string name() const override { return "gpt_oss"; }
  std::vector<std::string> model_types() const override { return {"gpt_oss"}; }

  ModelConfig parse_config(const io::JsonFields& fields) const override {
    ModelConfig g;
    auto own = std::make_shared<GptOssConfig>();
    parse_fields(fields, g, *own);
    g.details = own;
    return g;
  }

  std::string to_hf_config_json(const ModelConfig& g) const override {
    return hf_config_text(fields_json(g, g.family_config<GptOssConfig>()), "GptOssForCausalLM", "gpt_oss");
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const GptOssConfig& c = g.family_config<GptOssConfig>();
    return decoder_model_specs(g, [&](int64_t layer) {
      const std::string prefix = layer_prefix(layer);
      std::vector<ParamSpec> specs = PreNormLayer::param_specs(
          layer_options(g, c, layer),
          GqaAttention::param_specs(attention_options(g, c, layer), prefix + "attn.", layer), prefix);
      attach_layer_pieces(specs, layer, "gpt_oss", [&](const LayerParam& p) { return attach_own_name(p, g, c); });
      return specs;
    });
  }

  std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& g, ParameterStore& store, int64_t layer) const override {
    const GptOssConfig& c = g.family_config<GptOssConfig>();
    const std::string prefix = layer_prefix(layer);
    auto attention = std::make_unique<GqaAttention>(attention_options(g, c, layer), store, prefix + "attn.");
    return std::make_unique<PreNormLayer>(layer_options(g, c, layer), std::move(attention), store, prefix);
  }

  ops::RmsNormParams final_norm(const ModelConfig& g) const override {
    return rms_norm_params(g.family_config<GptOssConfig>().rms_norm_eps);
  }

  LayerFlops layer_flops(const ModelConfig& g, int64_t layer, int64_t context) const override {
    const GptOssConfig& c = g.family_config<GptOssConfig>();
    const double h = double(g.hidden_size), hd = double(c.head_dim);
    const double nh = double(c.num_attention_heads), nkv = double(c.num_key_value_heads);
    LayerFlops f;
    f.matmul_weights = h * (nh + 2 * nkv) * hd + nh * hd * h + h * double(g.num_experts) +
                       double(g.num_experts_per_tok) * 3 * h * double(c.intermediate_size);
    // Keys seen per query: about context / 2 under the causal mask, at most the window on a sliding layer.
    double keys = double(context) / 2;
    const int64_t window = c.sliding_layers[static_cast<size_t>(layer)] ? c.sliding_window : 0;
    if (window > 0 && double(window) < keys) keys = double(window);
    f.attention_core = 2 * keys * nh * (2 * hd);  // scores and values
    return f;
  }

  LayerActivationShape layer_activation_shape(const ModelConfig& g, int64_t) const override {
    const GptOssConfig& c = g.family_config<GptOssConfig>();
    LayerActivationShape s;
    s.moe = true;
    s.width = c.intermediate_size;
    s.heads = c.num_attention_heads;
    s.kv_heads = c.num_key_value_heads;
    s.q_cols = c.num_attention_heads * c.head_dim;
    s.kv_cols = c.num_key_value_heads * c.head_dim;
    return s;
  }

  // Built from batch-invariant ops (biased projections, per-document attention with a window, the sink rescale per
  // (token, head), per-row router and activation): the exact program holds on the CPU and on CUDA's batch-invariant
  // kernels.
  ExactCertification exact_certification(const ModelConfig&) const override { return {true, ""}; }
};

}  // namespace

const Family& family() {
  static const GptOssFamily instance;
  return instance;
}

}  // namespace moetrain::model::families::gpt_oss
