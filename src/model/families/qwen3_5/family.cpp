// defines: the Qwen3.5 family: its config, its parameters and HF names, its layers (Gated DeltaNet or gated full
// attention, then the dense MLP or the routed experts with the gated shared expert), FLOPs and certification.
#include "model/families/qwen3_5/family.h"

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/blocks/attention.h"
#include "model/blocks/gated_delta_net.h"
#include "model/blocks/pre_norm_layer.h"
#include "model/families/qwen3_5/config.h"
#include "model/pre_norm_decoder.h"

namespace moetrain::model::families::qwen3_5 {

namespace {

bool is_linear(const Qwen3_5Config& c, int64_t layer) { return c.linear_layers[static_cast<size_t>(layer)]; }

ops::RmsNormParams norm_params(const Qwen3_5Config& c) {
  ops::RmsNormParams norm = rms_norm_params(c.rms_norm_eps);
  norm.zero_centered = true;  // Qwen3_5RMSNorm: x * rstd * (1 + w)
  return norm;
}

AttentionOptions attention_options(const ModelConfig& g, const Qwen3_5Config& c) {
  AttentionOptions o;
  o.hidden_size = g.hidden_size;
  o.num_heads = c.num_attention_heads;
  o.num_kv_heads = c.num_key_value_heads;
  o.head_dim = c.head_dim;
  o.qk_norm = true;
  o.qk_norm_zero_centered = true;
  o.norm_eps = static_cast<float>(c.rms_norm_eps);
  o.rope = ops::rope_default_params(static_cast<int>(c.rotary_dim()), c.rope_theta);
  o.output_gate = true;
  return o;
}

GatedDeltaNetOptions linear_options(const ModelConfig& g, const Qwen3_5Config& c) {
  GatedDeltaNetOptions o;
  o.hidden_size = g.hidden_size;
  o.num_key_heads = c.linear_num_key_heads;
  o.num_value_heads = c.linear_num_value_heads;
  o.key_head_dim = c.linear_key_head_dim;
  o.value_head_dim = c.linear_value_head_dim;
  o.conv_kernel = c.linear_conv_kernel_dim;
  o.norm_eps = static_cast<float>(c.rms_norm_eps);
  return o;
}

PreNormLayerOptions layer_options(const ModelConfig& g, const Qwen3_5Config& c, int64_t layer) {
  PreNormLayerOptions o = pre_norm_layer_options(g, layer, norm_params(c));
  if (!g.layer_is_moe(layer)) {
    o.dense_mlp = dense_mlp_options(g, c.intermediate_size);
    return o;
  }
  MoeOptions moe = routed_experts_options(g, c.moe_intermediate_size, true);  // Qwen3_5MoeTopKRouter renormalises
  SharedExpertOptions shared;
  shared.hidden_size = g.hidden_size;
  shared.intermediate_size = c.shared_expert_intermediate_size;
  shared.sigmoid_gate = true;
  moe.shared_expert = shared;
  o.moe = moe;
  return o;
}

// The token mixer's parameters of layer `layer`: "<prefix>linear_attn." (Gated DeltaNet) or "<prefix>attn.".
std::vector<ParamSpec> mixer_specs(const ModelConfig& g, const Qwen3_5Config& c, int64_t layer) {
  const std::string prefix = layer_prefix(layer);
  if (is_linear(c, layer)) return GatedDeltaNet::param_specs(linear_options(g, c), prefix + "linear_attn.", layer);
  return GqaAttention::param_specs(attention_options(g, c), prefix + "attn.", layer);
}

// transformers' names for the parameters of a decoder layer that are Qwen3.5's own (pre_norm_decoder.h has the
// rest): the Gated DeltaNet's and the gated shared expert's.
bool attach_own_name(const LayerParam& p, const Qwen3_5Config& c) {
  const std::string& local = p.local;
  if (local == "linear_attn.conv") {
    const int64_t conv_channels =
        2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
    p.whole("linear_attn.conv1d.weight", {conv_channels, 1, c.linear_conv_kernel_dim});  // [C, 1, K] read as [C, K]
  } else if (local == "linear_attn.A_log" || local == "linear_attn.dt_bias") {
    p.whole(local);
  } else if (local.starts_with("linear_attn.")) {
    p.whole(local + ".weight");  // in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, norm, out_proj
  } else if (local == "shared_expert.gate_up" || local == "shared_expert.down") {
    attach_hf_mlp_pieces(p.spec, p.hf_prefix + "mlp.shared_expert.", false, local == "shared_expert.gate_up");
  } else if (local == "shared_expert.sigmoid_gate") {
    p.whole("mlp.shared_expert_gate.weight");
  } else {
    return false;
  }
  return true;
}

class Qwen3_5Family final : public Family {
 public:
  std::string name() const override { return "qwen3_5"; }
  std::vector<std::string> model_types() const override {
    return {kDenseTextType, kMoeTextType, "qwen3_5", "qwen3_5_moe"};
  }

  NestedConfig nested_config(const std::string& model_type) const override {
    if (model_type == "qwen3_5") return {"text_config", kDenseTextType};
    if (model_type == "qwen3_5_moe") return {"text_config", kMoeTextType};
    return {};
  }

  // The released checkpoints (Qwen3_5ForConditionalGeneration and its MoE twin) hold the text model under
  // "model.language_model.", the vision tower under "model.visual." and the multi-token-prediction layers under
  // "mtp.": transformers' text model drops the "language_model" level and ignores the other two.
  std::string checkpoint_tensor_name(const std::string& name) const override {
    constexpr std::string_view kWrapped = "model.language_model.";
    if (name.starts_with(kWrapped)) return "model." + name.substr(kWrapped.size());
    if (name.starts_with("model.visual.") || name.starts_with("mtp.")) return "";
    return name;
  }

  ModelConfig parse_config(const io::JsonFields& fields) const override {
    const std::string type = fields.require_string("model_type");
    MT_CHECK(type == kDenseTextType || type == kMoeTextType,
             "{}: model_type '{}' is not a Qwen3.5 text model ({}, {}; the multimodal wrappers are read through their "
             "text_config)",
             fields.source(), type, kDenseTextType, kMoeTextType);
    ModelConfig g;
    auto own = std::make_shared<Qwen3_5Config>();
    parse_fields(fields, type == kMoeTextType, g, *own);
    g.details = own;
    return g;
  }

  std::string to_hf_config_json(const ModelConfig& g) const override {
    const Qwen3_5Config& c = g.family_config<Qwen3_5Config>();
    return hf_config_text(fields_json(g, c), c.moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM",
                          c.moe ? kMoeTextType : kDenseTextType);
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const Qwen3_5Config& c = g.family_config<Qwen3_5Config>();
    const auto layer_specs = [&](int64_t layer) {
      std::vector<ParamSpec> specs =
          PreNormLayer::param_specs(layer_options(g, c, layer), mixer_specs(g, c, layer), layer_prefix(layer));
      attach_layer_pieces(specs, layer, "qwen3_5", [&](const LayerParam& p) { return attach_own_name(p, c); });
      return specs;
    };
    return decoder_model_specs(g, layer_specs, ParamInit::Zeros);  // the final norm is zero-centred: 1 + w
  }

  std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& g, ParameterStore& store, int64_t layer) const override {
    const Qwen3_5Config& c = g.family_config<Qwen3_5Config>();
    const std::string prefix = layer_prefix(layer);
    std::unique_ptr<TokenMixer> mixer;
    if (is_linear(c, layer)) {
      mixer = std::make_unique<GatedDeltaNet>(linear_options(g, c), store, prefix + "linear_attn.");
    } else {
      mixer = std::make_unique<GqaAttention>(attention_options(g, c), store, prefix + "attn.");
    }
    return std::make_unique<PreNormLayer>(layer_options(g, c, layer), std::move(mixer), store, prefix);
  }

  ops::RmsNormParams final_norm(const ModelConfig& g) const override {
    return norm_params(g.family_config<Qwen3_5Config>());
  }

  LayerFlops layer_flops(const ModelConfig& g, int64_t layer, int64_t context) const override {
    const Qwen3_5Config& c = g.family_config<Qwen3_5Config>();
    const double h = double(g.hidden_size);
    LayerFlops f;
    if (is_linear(c, layer)) {
      const double dk = double(c.linear_key_head_dim), dv = double(c.linear_value_head_dim);
      const double hk = double(c.linear_num_key_heads), hv = double(c.linear_num_value_heads);
      const double channels = 2 * hk * dk + hv * dv;
      // in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj, and the depthwise conv (K weights per channel).
      f.matmul_weights = h * (channels + hv * dv + 2 * hv) + hv * dv * h + channels * double(c.linear_conv_kernel_dim);
      // The recurrence per token and value head, whatever the context: the decay, S^T k, the rank-1 update and
      // S^T q, each about 2 dk dv.
      f.attention_core = hv * 8 * dk * dv;
    } else {
      const double hd = double(c.head_dim), nh = double(c.num_attention_heads), nkv = double(c.num_key_value_heads);
      f.matmul_weights = h * (2 * nh + 2 * nkv) * hd + nh * hd * h;  // q and its gate, k, v, o
      f.attention_core = 4 * (double(context) / 2) * nh * hd;        // causal: half the context on average
    }
    if (g.layer_is_moe(layer)) {
      f.matmul_weights += h * double(g.num_experts) + h;  // router, shared expert gate
      f.matmul_weights += double(g.num_experts_per_tok) * 3 * h * double(c.moe_intermediate_size);
      f.matmul_weights += 3 * h * double(c.shared_expert_intermediate_size);
    } else {
      f.matmul_weights += 3 * h * double(c.intermediate_size);
    }
    return f;
  }

  // Built from batch-invariant CPU ops: per-row projections, norms and gates; the conv and the delta rule run per
  // document in a fixed order; attention as Qwen3's. A_log and dt_bias are 1-D, so f32 under bf16 compute: their
  // specs name the pins the admission certifies.
  LayerActivationShape layer_activation_shape(const ModelConfig& g, int64_t layer) const override {
    const Qwen3_5Config& c = g.family_config<Qwen3_5Config>();
    if (is_linear(c, layer)) return {.not_modeled = "gated delta net"};
    if (g.layer_is_moe(layer)) return {.not_modeled = "shared expert"};
    LayerActivationShape s;  // gated full attention with q/k norm, then the dense gated MLP
    s.width = c.intermediate_size;
    s.heads = c.num_attention_heads;
    s.kv_heads = c.num_key_value_heads;
    s.q_cols = c.num_attention_heads * c.head_dim;
    s.kv_cols = c.num_key_value_heads * c.head_dim;
    s.qk_norm = true;
    s.output_gate = true;
    return s;
  }

  ExactCertification exact_certification(const ModelConfig&) const override { return {true, ""}; }
};

}  // namespace

const Family& family() {
  static const Qwen3_5Family instance;
  return instance;
}

}  // namespace moetrain::model::families::qwen3_5
