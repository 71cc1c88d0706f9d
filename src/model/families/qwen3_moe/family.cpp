// defines: the Qwen3-MoE family: config.json's "qwen3_moe", its parameters, its layers (Qwen3's attention; a
// softmax top-k router and a SwiGLU expert bank on MoE layers, the dense MLP elsewhere), FLOPs and certification.
#include "model/families/qwen3_moe/family.h"

#include <utility>

#include <nlohmann/json.hpp>

#include "model/families/qwen3/layout.h"
#include "model/families/qwen3_moe/config.h"

namespace moetrain::model::families::qwen3_moe {

namespace {

PreNormLayerOptions layer_options(const ModelConfig& g, const Qwen3MoeConfig& c, int64_t layer) {
  PreNormLayerOptions o = pre_norm_layer_options(g, layer, rms_norm_params(c.rms_norm_eps));
  if (g.layer_is_moe(layer)) {
    o.moe = routed_experts_options(g, c.moe_intermediate_size, c.norm_topk_prob);
  } else {
    o.dense_mlp = dense_mlp_options(g, c.intermediate_size);
  }
  return o;
}

class Qwen3MoeFamily final : public Family {
 public:
  std::string name() const override { return "qwen3_moe"; }
  std::vector<std::string> model_types() const override { return {"qwen3_moe"}; }

  ModelConfig parse_config(const io::JsonFields& fields) const override {
    ModelConfig g;
    auto own = std::make_shared<Qwen3MoeConfig>();
    qwen3::parse_shared_fields(fields, g, *own);
    parse_moe_fields(fields, g, *own);
    g.details = own;
    return g;
  }

  std::string to_hf_config_json(const ModelConfig& g) const override {
    const Qwen3MoeConfig& c = g.family_config<Qwen3MoeConfig>();
    nlohmann::json j = qwen3::shared_fields_json(g, c);
    j.update(moe_fields_json(g, c));
    return hf_config_text(std::move(j), "Qwen3MoeForCausalLM", "qwen3_moe");
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const Qwen3MoeConfig& c = g.family_config<Qwen3MoeConfig>();
    return qwen3::model_param_specs(g, c, [&](int64_t layer) { return layer_options(g, c, layer); });
  }

  std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& g, ParameterStore& store, int64_t layer) const override {
    const Qwen3MoeConfig& c = g.family_config<Qwen3MoeConfig>();
    return qwen3::make_pre_norm_layer(g, c, store, layer_options(g, c, layer));
  }

  ops::RmsNormParams final_norm(const ModelConfig& g) const override {
    return rms_norm_params(g.family_config<Qwen3MoeConfig>().rms_norm_eps);
  }

  LayerFlops layer_flops(const ModelConfig& g, int64_t layer, int64_t context) const override {
    const Qwen3MoeConfig& c = g.family_config<Qwen3MoeConfig>();
    LayerFlops f = qwen3::attention_flops(g, c, context);
    const double h = double(g.hidden_size);
    if (g.layer_is_moe(layer)) {
      f.matmul_weights += h * double(g.num_experts);  // router
      f.matmul_weights += double(g.num_experts_per_tok) * 3 * h * double(c.moe_intermediate_size);
    } else {
      f.matmul_weights += 3 * h * double(c.intermediate_size);
    }
    return f;
  }

  LayerActivationShape layer_activation_shape(const ModelConfig& g, int64_t layer) const override {
    const Qwen3MoeConfig& c = g.family_config<Qwen3MoeConfig>();
    LayerActivationShape s = qwen3::attention_activation_shape(c);
    s.moe = g.layer_is_moe(layer);
    s.width = s.moe ? c.moe_intermediate_size : c.intermediate_size;
    return s;
  }

  ExactCertification exact_certification(const ModelConfig&) const override { return {true, ""}; }
};

}  // namespace

const Family& family() {
  static const Qwen3MoeFamily instance;
  return instance;
}

}  // namespace moetrain::model::families::qwen3_moe
