// defines: the Qwen3 family: config.json's "qwen3", its parameters, its layers (GQA attention with q/k norm and a
// dense SwiGLU MLP, pre-norm), its FLOPs and its exact-mode certification.
#include "model/families/qwen3/family.h"

#include <nlohmann/json.hpp>

#include "model/families/qwen3/config.h"
#include "model/families/qwen3/layout.h"

namespace moetrain::model::families::qwen3 {

namespace {

PreNormLayerOptions layer_options(const ModelConfig& g, const Qwen3Config& c, int64_t layer) {
  PreNormLayerOptions o;
  o.layer = layer;
  o.hidden_size = g.hidden_size;
  o.norm.eps = static_cast<float>(c.rms_norm_eps);
  GatedMlpOptions mlp;
  mlp.hidden_size = g.hidden_size;
  mlp.intermediate_size = c.intermediate_size;
  o.dense_mlp = mlp;
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
    nlohmann::json j = shared_fields_json(g, g.family_config<Qwen3Config>());
    j["architectures"] = nlohmann::json::array({"Qwen3ForCausalLM"});
    j["model_type"] = "qwen3";
    return j.dump(2) + "\n";
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
    ops::RmsNormParams norm;
    norm.eps = static_cast<float>(g.family_config<Qwen3Config>().rms_norm_eps);
    return norm;
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
