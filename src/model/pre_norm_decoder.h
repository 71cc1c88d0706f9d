// defines: what the pre-norm decoder families share, so that each family's folder holds only what differs: the
// internal prefix of a decoder layer, the HF names every transformers decoder layer gives its norms, attention
// projections, router, MLP and expert bank (a family names the rest), the options of a layer's norms and of its
// dense MLP or routed experts, and a family's config.json text.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/blocks/pre_norm_layer.h"
#include "model/model_config.h"
#include "model/parameter_store.h"

namespace moetrain::model {

// The prefix of decoder layer `layer`'s internal parameter names ("layers.3.").
std::string layer_prefix(int64_t layer);

// One parameter of a decoder layer while it is given its HF pieces.
struct LayerParam {
  ParamSpec& spec;
  std::string local;      // its name under the layer's prefix: "attn.q_proj", "experts.down"
  std::string hf_prefix;  // the layer's HF prefix: "model.layers.3."

  // One piece, the whole tensor under hf_prefix + `hf_name`, in the spec's shape or in `hf_shape`.
  void whole(const std::string& hf_name) const;
  void whole(const std::string& hf_name, Shape hf_shape) const;
};

// A family's own HF names: gives the parameter its pieces and returns true, or returns false to leave it to the names
// every decoder layer shares.
using FamilyLayerNames = std::function<bool(const LayerParam& param)>;

// Gives every parameter of decoder layer `layer` (fresh specs under layer_prefix(layer)) transformers' names: the
// family's own first, then the shared ones: input_layernorm, post_attention_layernorm, "attn.X" as
// self_attn.X.weight, the router as mlp.gate, the dense MLP and the expert bank under mlp. A parameter that neither
// names is an error naming `family` and the parameter.
void attach_layer_pieces(std::vector<ParamSpec>& specs, int64_t layer, const std::string& family,
                         const FamilyLayerNames& own_names);

// A pre-norm layer's options up to its MLP: its index, its MoE index, the width and the norms.
PreNormLayerOptions pre_norm_layer_options(const ModelConfig& config, int64_t layer, const ops::RmsNormParams& norm);
// The dense SwiGLU MLP of `intermediate_size`.
GatedMlpOptions dense_mlp_options(const ModelConfig& config, int64_t intermediate_size);
// The routed experts of a MoE layer as most families build them: a softmax router over config.num_experts keeping
// config.num_experts_per_tok (renormalised or not), and a SwiGLU expert bank of `intermediate_size`.
MoeOptions routed_experts_options(const ModelConfig& config, int64_t intermediate_size, bool renormalize);

// RMSNorm parameters of epsilon `eps` (config.json's rms_norm_eps).
ops::RmsNormParams rms_norm_params(double eps);

// A family's config.json text: its `fields` with "architectures": [architecture] and "model_type".
std::string hf_config_text(nlohmann::json fields, const std::string& architecture, const std::string& model_type);

}  // namespace moetrain::model
