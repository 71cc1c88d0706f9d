// defines: the parts the pre-norm decoder families share (pre_norm_decoder.h).
#include "model/pre_norm_decoder.h"

#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain::model {

std::string layer_prefix(int64_t layer) { return fmt::format("layers.{}.", layer); }

void LayerParam::whole(const std::string& hf_name) const { whole(hf_name, spec.shape); }

void LayerParam::whole(const std::string& hf_name, Shape hf_shape) const {
  spec.pieces.push_back({hf_prefix + hf_name, std::move(hf_shape), 0, {}, {}});
}

namespace {

// The names transformers gives the same parameter in every decoder family; false for any other.
bool attach_shared_name(const LayerParam& p) {
  const std::string& local = p.local;
  if (local == "input_norm") {
    p.whole("input_layernorm.weight");
  } else if (local == "post_norm") {
    p.whole("post_attention_layernorm.weight");
  } else if (local.starts_with("attn.")) {
    p.whole("self_attn." + local.substr(5) + ".weight");  // q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, ...
  } else if (local == "router") {
    p.whole("mlp.gate.weight");
  } else if (local == "mlp.gate_up" || local == "experts.gate_up") {
    attach_hf_mlp_pieces(p.spec, p.hf_prefix + "mlp.", local == "experts.gate_up", true);
  } else if (local == "mlp.down" || local == "experts.down") {
    attach_hf_mlp_pieces(p.spec, p.hf_prefix + "mlp.", local == "experts.down", false);
  } else {
    return false;
  }
  return true;
}

}  // namespace

void attach_layer_pieces(std::vector<ParamSpec>& specs, int64_t layer, const std::string& family,
                         const FamilyLayerNames& own_names) {
  const std::string prefix = layer_prefix(layer);
  const std::string hf_prefix = fmt::format("model.layers.{}.", layer);
  for (ParamSpec& spec : specs) {
    MT_CHECK(spec.name.starts_with(prefix) && spec.pieces.empty(),
             "{} layout: parameter '{}' is not a fresh parameter of layer {}", family, spec.name, layer);
    const LayerParam param{spec, spec.name.substr(prefix.size()), hf_prefix};
    const bool named = (own_names && own_names(param)) || attach_shared_name(param);
    MT_CHECK(named, "{} layout: no HF name for parameter '{}'", family, spec.name);
  }
}

PreNormLayerOptions pre_norm_layer_options(const ModelConfig& config, int64_t layer, const ops::RmsNormParams& norm) {
  PreNormLayerOptions o;
  o.layer = layer;
  o.moe_index = config.moe_index(layer);
  o.hidden_size = config.hidden_size;
  o.norm = norm;
  return o;
}

GatedMlpOptions dense_mlp_options(const ModelConfig& config, int64_t intermediate_size) {
  GatedMlpOptions mlp;
  mlp.hidden_size = config.hidden_size;
  mlp.intermediate_size = intermediate_size;
  return mlp;
}

MoeOptions routed_experts_options(const ModelConfig& config, int64_t intermediate_size, bool renormalize) {
  MoeOptions moe;
  moe.router.hidden_size = config.hidden_size;
  moe.router.num_experts = config.num_experts;
  moe.router.top_k = config.num_experts_per_tok;
  moe.router.renormalize = renormalize;
  moe.experts = dense_mlp_options(config, intermediate_size);
  moe.experts.num_experts = config.num_experts;
  moe.experts.role = ParamRole::ExpertBank;
  return moe;
}

ops::RmsNormParams rms_norm_params(double eps) {
  ops::RmsNormParams norm;
  norm.eps = static_cast<float>(eps);
  return norm;
}

std::string hf_config_text(nlohmann::json fields, const std::string& architecture, const std::string& model_type) {
  fields["architectures"] = nlohmann::json::array({architecture});
  fields["model_type"] = model_type;
  return fields.dump(2) + "\n";
}

}  // namespace moetrain::model
