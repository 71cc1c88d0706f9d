// defines: Family, everything that differs between model families (Qwen3, Qwen3-MoE, ...), and the registry that
// maps config.json's model_type to one. A family is a folder, model/families/<family>/: its config parser, its
// parameter layout with the HF adapter, its decoder layer built from the generic blocks (model/blocks/), its FLOPs
// and what the exact contract certifies for it. The registry lists every folder there (generated at configure time),
// so adding a family touches nothing outside its folder, blocks/ and ops/.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/json_fields.h"
#include "model/decoder_layer.h"
#include "model/model_config.h"
#include "model/parameter_store.h"
#include "ops/norm.h"

namespace moetrain::model {

// Per-token forward FLOPs of one decoder layer: 2 x the matmul weights a token touches, and the attention core's
// FLOPs at a given context (its score and value products).
struct LayerFlops {
  double matmul_weights = 0.0;  // weights of every matmul a token goes through (projections, router, top-k experts)
  double attention_core = 0.0;  // forward FLOPs of the attention core for one token
};

// What one decoder layer's activation records hold per token, for the memory planner (train/memory_plan.cpp), in the
// terms of the generic blocks: a GQA attention of q_cols = heads x head_dim query columns (twice that from q_proj
// with an output gate) over kv_cols key and value columns, then a gated MLP of `width` (each routed expert's, for an
// MoE layer). A layer the planner does not model (latent attention, gated delta net, a shared expert) says what in
// `not_modeled`.
struct LayerActivationShape {
  std::string not_modeled;  // empty: modeled
  bool moe = false;
  int64_t width = 0;
  int64_t q_cols = 0, kv_cols = 0, heads = 0, kv_heads = 0;
  bool qk_norm = false, output_gate = false;
};

// What the exact contract (exact/admission.h) may certify for a family.
struct ExactCertification {
  bool certified = false;
  std::string reason;  // why not, when not: named in the refusal
};

class Family {
 public:
  virtual ~Family() = default;

  // The folder's name ("qwen3") and the config.json model_type values it serves.
  virtual std::string name() const = 0;
  virtual std::vector<std::string> model_types() const = 0;

  // A model_type whose config.json wraps the model the engine trains in a sub-object (a multimodal model, e.g.
  // Qwen3.5's "qwen3_5" with its "text_config"): that sub-object's key, and the model_type it stands for when it names
  // none. parse_model_config then parses the sub-object as the config and says in a log line what it leaves out (the
  // wrapper's other objects: a vision tower). An empty key (the default): the top level is the model's config.
  struct NestedConfig {
    std::string key;
    std::string model_type;
  };
  virtual NestedConfig nested_config(const std::string& /*model_type*/) const { return {}; }

  // The name under which the engine reads a checkpoint tensor: a released multimodal checkpoint keeps its text model
  // under another prefix (Qwen3.5's "model.language_model.") and carries parts the text model does not train (a
  // vision tower, multi-token-prediction layers), as transformers' text model reads it. An empty name leaves the
  // tensor out (CausalLm::load_hf_weights counts those by prefix in a log line). Default: every name as it is.
  virtual std::string checkpoint_tensor_name(const std::string& name) const { return name; }

  // Fills the generic fields of ModelConfig and the family's own (ModelConfig::details) from config.json's top-level
  // object; refuses every value it does not support, naming the field.
  virtual ModelConfig parse_config(const io::JsonFields& fields) const = 0;
  // The config.json that transformers reads back as the same model.
  virtual std::string to_hf_config_json(const ModelConfig& config) const = 0;

  // The parameters in the engine's layout, each with its role, layer and HF pieces (the HF adapter).
  virtual std::vector<ParamSpec> param_specs(const ModelConfig& config) const = 0;
  // Decoder layer `layer`, reading its weights from `store` (which holds param_specs(config)).
  virtual std::unique_ptr<DecoderLayer> make_layer(const ModelConfig& config, ParameterStore& store,
                                                   int64_t layer) const = 0;
  // The final norm before the head.
  virtual ops::RmsNormParams final_norm(const ModelConfig& config) const = 0;

  virtual LayerFlops layer_flops(const ModelConfig& config, int64_t layer, int64_t context) const = 0;
  virtual LayerActivationShape layer_activation_shape(const ModelConfig& config, int64_t layer) const = 0;
  virtual ExactCertification exact_certification(const ModelConfig& config) const = 0;
};

// The family serving `model_type`; an unknown type is an error that lists the supported ones.
const Family& family_for(const std::string& model_type, const std::string& source);
// Every registered family, in folder order.
const std::vector<const Family*>& registered_families();
// "qwen3, qwen3_moe, ...": every supported model_type.
std::string supported_model_types();

}  // namespace moetrain::model
