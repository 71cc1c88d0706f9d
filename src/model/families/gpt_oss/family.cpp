// defines: the GPT-OSS family: config.json's "gpt_oss", its parameters and HF names (the experts' [E, H, 2I] gate_up
// with alternating gate and up columns, read through strided pieces), its layers, FLOPs and certification.
#include "model/families/gpt_oss/family.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/blocks/attention.h"
#include "model/blocks/pre_norm_layer.h"
#include "model/families/gpt_oss/config.h"

namespace moetrain::model::families::gpt_oss {

namespace {

std::string layer_prefix(int64_t layer) { return fmt::format("layers.{}.", layer); }

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
  PreNormLayerOptions o;
  o.layer = layer;
  o.moe_index = g.moe_index(layer);
  o.hidden_size = g.hidden_size;
  o.norm.eps = static_cast<float>(c.rms_norm_eps);
  MoeOptions moe;
  moe.router.hidden_size = g.hidden_size;
  moe.router.num_experts = g.num_experts;
  moe.router.top_k = g.num_experts_per_tok;
  moe.router.topk_before_softmax = true;
  moe.router.bias = true;
  GatedMlpOptions experts;
  experts.hidden_size = g.hidden_size;
  experts.intermediate_size = c.intermediate_size;
  experts.num_experts = g.num_experts;
  experts.role = ParamRole::ExpertBank;
  experts.activation = GatedActivation::ClampedSwiGlu;
  experts.swiglu_alpha = kSwigluAlpha;
  experts.swiglu_limit = kSwigluLimit;
  experts.bias = true;
  moe.experts = experts;
  o.moe = moe;
  return o;
}

// transformers' names for the parameters of decoder layer `layer`. The experts are stored [E, in, out] (x @ W) with
// gate_up's columns alternating gate (even) and up (odd); internally gate_up is [E, 2I, H], gate rows first.
void attach_layer_pieces(std::vector<ParamSpec>& specs, const ModelConfig& g, const GptOssConfig& c, int64_t layer) {
  const std::string prefix = layer_prefix(layer);
  const std::string hf = fmt::format("model.layers.{}.", layer);
  const int64_t e = g.num_experts, h = g.hidden_size, i = c.intermediate_size;
  for (ParamSpec& spec : specs) {
    MT_CHECK(spec.name.rfind(prefix, 0) == 0 && spec.pieces.empty(),
             "gpt_oss layout: parameter '{}' is not a fresh parameter of layer {}", spec.name, layer);
    const std::string local = spec.name.substr(prefix.size());
    const auto whole = [&](const std::string& hf_name) {
      spec.pieces.push_back({hf + hf_name, spec.shape, 0, {}, {}});
    };
    if (local == "input_norm") {
      whole("input_layernorm.weight");
    } else if (local == "post_norm") {
      whole("post_attention_layernorm.weight");
    } else if (local == "attn.q_proj" || local == "attn.k_proj" || local == "attn.v_proj" || local == "attn.o_proj") {
      whole("self_attn." + local.substr(5) + ".weight");
    } else if (local == "attn.q_bias" || local == "attn.k_bias" || local == "attn.v_bias" || local == "attn.o_bias") {
      whole("self_attn." + local.substr(5, 1) + "_proj.bias");
    } else if (local == "attn.sinks") {
      whole("self_attn.sinks");
    } else if (local == "router") {
      whole("mlp.router.weight");
    } else if (local == "router_bias") {
      whole("mlp.router.bias");
    } else if (local == "experts.gate_up") {
      // HF (e, h, 2j + p) -> internal (e, p * I + j, h): p = 0 gate, 1 up.
      spec.pieces.push_back(
          strided_piece(hf + "mlp.experts.gate_up_proj", {e, h, 2 * i}, 0, {e, h, i, 2}, {2 * i * h, 1, h, i * h}));
      spec.pieces.back().mxfp4_transposed = true;  // released checkpoints: gate_up_proj_blocks [E, 2I, H / 32, 16]
    } else if (local == "experts.gate_up_bias") {
      spec.pieces.push_back(
          strided_piece(hf + "mlp.experts.gate_up_proj_bias", {e, 2 * i}, 0, {e, i, 2}, {2 * i, 1, i}));
    } else if (local == "experts.down") {
      // HF (e, j, h) -> internal (e, h, j).
      spec.pieces.push_back(strided_piece(hf + "mlp.experts.down_proj", {e, i, h}, 0, {e, i, h}, {h * i, 1, i}));
      spec.pieces.back().mxfp4_transposed = true;  // down_proj_blocks [E, H, I / 32, 16]
    } else if (local == "experts.down_bias") {
      whole("mlp.experts.down_proj_bias");
    } else {
      MT_FAIL("gpt_oss layout: no HF name for parameter '{}'", spec.name);
    }
  }
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
    nlohmann::json j = fields_json(g, g.family_config<GptOssConfig>());
    j["architectures"] = nlohmann::json::array({"GptOssForCausalLM"});
    j["model_type"] = "gpt_oss";
    return j.dump(2) + "\n";
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const GptOssConfig& c = g.family_config<GptOssConfig>();
    return decoder_model_specs(g, [&](int64_t layer) {
      const std::string prefix = layer_prefix(layer);
      std::vector<ParamSpec> specs = PreNormLayer::param_specs(
          layer_options(g, c, layer),
          GqaAttention::param_specs(attention_options(g, c, layer), prefix + "attn.", layer), prefix);
      attach_layer_pieces(specs, g, c, layer);
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
    ops::RmsNormParams norm;
    norm.eps = static_cast<float>(g.family_config<GptOssConfig>().rms_norm_eps);
    return norm;
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
