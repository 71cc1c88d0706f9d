// defines: the Qwen3 family: config.json's "qwen3", its parameters, its layers (GQA attention with q/k norm and a
// dense SwiGLU MLP, pre-norm), its FLOPs and its exact-mode certification.
#include "model/families/qwen3/family.h"

#include <nlohmann/json.hpp>

#include "model/families/qwen3/config.h"
#include "model/families/qwen3/layout.h"

namespace moetrain::model::families::qwen3 {

namespace {

PreNormLayerOptions layer_options(const ModelConfig& g, const Qwen3Config& c, int64_t layer) {
  PreNormLayerOptions o = pre_norm_layer_options(g, layer, rms_norm_params(c.rms_norm_eps));
  o.dense_mlp = dense_mlp_options(g, c.intermediate_size);
  return o;
}

class Qwen3Family final : public Family {
 public:
  std::string name() const override { return "qwen3"; }
  std::vector<std::string> model_types() const override { return {"qwen3"}; }

  ModelConfig parse_config(const io::JsonFields& fields) const override {
    ModelConfig g;
    auto own = std::make_shared<Qwen3Config>();
    parse_shared_fields(fields, g, *own);
    g.moe_layers.assign(static_cast<size_t>(g.num_hidden_layers), false);
    g.details = own;
    return g;
  }

  std::string to_hf_config_json(const ModelConfig& g) const override {
    return hf_config_text(shared_fields_json(g, g.family_config<Qwen3Config>()), "Qwen3ForCausalLM", "qwen3");
  }

  std::vector<ParamSpec> param_specs(const ModelConfig& g) const override {
    const Qwen3Config& c = g.family_config<Qwen3Config>();
    return model_param_specs(g, c, [&](int64_t layer) { return layer_options(g, c, layer); });
  }

  std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& g, ParameterStore& store, int64_t layer) const override {
    const Qwen3Config& c = g.family_config<Qwen3Config>();
    return make_pre_norm_layer(g, c, store, layer_options(g, c, layer));
  }

  ops::RmsNormParams final_norm(const ModelConfig& g) const override {
    return rms_norm_params(g.family_config<Qwen3Config>().rms_norm_eps);
  }

  LayerFlops layer_flops(const ModelConfig& g, int64_t, int64_t context) const override {
    const Qwen3Config& c = g.family_config<Qwen3Config>();
    LayerFlops f = attention_flops(g, c, context);
    f.matmul_weights += 3 * double(g.hidden_size) * double(c.intermediate_size);  // gate, up, down
    return f;
  }

  LayerActivationShape layer_activation_shape(const ModelConfig& g, int64_t) const override {
    const Qwen3Config& c = g.family_config<Qwen3Config>();
    LayerActivationShape s = attention_activation_shape(c);
    s.width = c.intermediate_size;
    return s;
  }

  ExactCertification exact_certification(const ModelConfig&) const override { return {true, ""}; }
};

}  // namespace

const Family& family() {
  static const Qwen3Family instance;
  return instance;
}

}  // namespace moetrain::model::families::qwen3
