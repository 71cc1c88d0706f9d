// defines: the DeepSeek-V2 family: config.json's "deepseek_v2", its parameters and HF names, its layers (latent
// attention; the dense MLP on the first first_k_dense_replace layers, then a softmax router over the routed experts
// and the shared experts), FLOPs and certification.
#include "model/families/deepseek_v2/family.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "model/blocks/latent_attention.h"
#include "model/blocks/pre_norm_layer.h"
#include "model/families/deepseek_v2/config.h"
#include "model/pre_norm_decoder.h"

namespace moetrain::model::families::deepseek_v2 {

namespace {

LatentAttentionOptions attention_options(const ModelConfig& g, const DeepseekV2Config& c) {
  LatentAttentionOptions o;
  o.hidden_size = g.hidden_size;
  o.num_heads = c.num_attention_heads;
  o.q_lora_rank = c.q_lora_rank;
  o.kv_lora_rank = c.kv_lora_rank;
  o.qk_nope_head_dim = c.qk_nope_head_dim;
  o.qk_rope_head_dim = c.qk_rope_head_dim;
  o.v_head_dim = c.v_head_dim;
  o.lora_norm_eps = 1e-6f;  // transformers builds q_a_layernorm and kv_a_layernorm with its default eps
  const int rotary = static_cast<int>(c.qk_rope_head_dim);
  o.rope =
      c.yarn ? ops::rope_yarn_params(rotary, c.rope_theta, *c.yarn) : ops::rope_default_params(rotary, c.rope_theta);
  o.rope.interleaved = true;  // transformers rotates the rope dims as complex pairs (2i, 2i + 1)
  // Under YaRN the softmax scale carries the temperature: 1 / sqrt(qk head dim) x mscale(factor, mscale_all_dim)^2.
  const double scaling = 1.0 / std::sqrt(double(c.qk_nope_head_dim + c.qk_rope_head_dim));
  o.softmax_scale = c.yarn ? ops::yarn_softmax_scale(scaling, *c.yarn) : scaling;
  return o;
}

PreNormLayerOptions layer_options(const ModelConfig& g, const DeepseekV2Config& c, int64_t layer) {
  PreNormLayerOptions o = pre_norm_layer_options(g, layer, rms_norm_params(c.rms_norm_eps));
  if (!g.layer_is_moe(layer)) {
    o.dense_mlp = dense_mlp_options(g, c.intermediate_size);
    return o;
  }
  // transformers' DeepSeek-V2 router ignores norm_topk_prob.
  MoeOptions moe = routed_experts_options(g, c.moe_intermediate_size, false);
  if (c.topk_method == "group_limited_greedy") {
    moe.router.num_groups = c.n_group;
    moe.router.topk_groups = c.topk_group;
  }
  moe.router.scaling_factor = c.routed_scaling_factor;
  if (c.n_shared_experts > 0) {
    SharedExpertOptions shared;
    shared.hidden_size = g.hidden_size;
    shared.intermediate_size = c.moe_intermediate_size * c.n_shared_experts;
    moe.shared_expert = shared;
  }
  o.moe = moe;
  return o;
}

// transformers' names for the parameters of a decoder layer that are DeepSeek-V2's own (pre_norm_decoder.h has the
// rest).
bool attach_own_name(const LayerParam& p) {
  if (p.local == "attn.kv_a_proj") {
    p.whole("self_attn.kv_a_proj_with_mqa.weight");
  } else if (p.local == "attn.q_a_norm") {
    p.whole("self_attn.q_a_layernorm.weight");
  } else if (p.local == "attn.kv_a_norm") {
    p.whole("self_attn.kv_a_layernorm.weight");
  } else if (p.local == "shared_expert.gate_up" || p.local == "shared_expert.down") {
    attach_hf_mlp_pieces(p.spec, p.hf_prefix + "mlp.shared_experts.", false, p.local == "shared_expert.gate_up");
  } else {
    return false;
  }
  return true;
}

class DeepseekV2Family final : public Family {
 public:
  std::string name() const override { return "deepseek_v2"; }
  std::vector<std::string> model_types() const override { return {"deepseek_v2"}; }

  ModelConfig parse_config(const io::JsonFields& fields) const override {
    ModelConfig g;
    auto own = std::make_shared<DeepseekV2Config>();
    parse_fields(fields, g, *own);
    g.details = own;
    return g;
  }

  std::string to_hf_config_json(const ModelConfig& g) const override {
    return hf_config_text(fields_json(g, g.family_config<DeepseekV2Config>()), "DeepseekV2ForCausalLM", "deepseek_v2");
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const DeepseekV2Config& c = g.family_config<DeepseekV2Config>();
    return decoder_model_specs(g, [&](int64_t layer) {
      const std::string prefix = layer_prefix(layer);
      std::vector<ParamSpec> specs = PreNormLayer::param_specs(
          layer_options(g, c, layer), LatentAttention::param_specs(attention_options(g, c), prefix + "attn.", layer),
          prefix);
      attach_layer_pieces(specs, layer, "deepseek_v2", attach_own_name);
      return specs;
    });
  }

  std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& g, ParameterStore& store, int64_t layer) const override {
    const DeepseekV2Config& c = g.family_config<DeepseekV2Config>();
    const std::string prefix = layer_prefix(layer);
    auto attention = std::make_unique<LatentAttention>(attention_options(g, c), store, prefix + "attn.");
    return std::make_unique<PreNormLayer>(layer_options(g, c, layer), std::move(attention), store, prefix);
  }

  ops::RmsNormParams final_norm(const ModelConfig& g) const override {
    return rms_norm_params(g.family_config<DeepseekV2Config>().rms_norm_eps);
  }

  LayerFlops layer_flops(const ModelConfig& g, int64_t layer, int64_t context) const override {
    const DeepseekV2Config& c = g.family_config<DeepseekV2Config>();
    const double h = double(g.hidden_size), nh = double(c.num_attention_heads);
    const double qk = double(c.qk_nope_head_dim + c.qk_rope_head_dim), dv = double(c.v_head_dim);
    const double rkv = double(c.kv_lora_rank);
    LayerFlops f;
    f.matmul_weights = (c.q_lora_rank > 0 ? h * double(c.q_lora_rank) + double(c.q_lora_rank) * nh * qk : h * nh * qk) +
                       h * (rkv + double(c.qk_rope_head_dim)) + rkv * nh * (double(c.qk_nope_head_dim) + dv) +
                       nh * dv * h;
    f.attention_core = 2 * (double(context) / 2) * nh * (qk + dv);  // scores (qk) and values (dv), causal
    if (g.layer_is_moe(layer)) {
      f.matmul_weights += h * double(g.num_experts) +
                          double(g.num_experts_per_tok + c.n_shared_experts) * 3 * h * double(c.moe_intermediate_size);
    } else {
      f.matmul_weights += 3 * h * double(c.intermediate_size);
    }
    return f;
  }

  // Latent attention is built from the same batch-invariant ops as Qwen3's attention (projections, norms, rope,
  // column moves, attention per document): the exact program holds on the CPU and on CUDA's batch-invariant kernels
  // (attention with d_qk != d_v included).
  LayerActivationShape layer_activation_shape(const ModelConfig&, int64_t) const override {
    return {.not_modeled = "latent attention"};
  }

  ExactCertification exact_certification(const ModelConfig&) const override { return {true, ""}; }
};

}  // namespace

const Family& family() {
  static const DeepseekV2Family instance;
  return instance;
}

}  // namespace moetrain::model::families::deepseek_v2
