// defines: the shared expert's parameters and construction (its math is the dense gated MLP's).
#include "model/blocks/shared_expert.h"

#include "core/error.h"

namespace moetrain::model {

GatedMlpOptions SharedExpert::mlp_options(const SharedExpertOptions& options) {
  MT_CHECK(!options.sigmoid_gate, "shared expert: the sigmoid gate is not supported yet");
  GatedMlpOptions mlp;
  mlp.hidden_size = options.hidden_size;
  mlp.intermediate_size = options.intermediate_size;
  mlp.role = ParamRole::SharedExpert;
  return mlp;
}

std::vector<ParamSpec> SharedExpert::param_specs(const SharedExpertOptions& options, const std::string& prefix,
                                                 int64_t layer) {
  return GatedMlp::param_specs(mlp_options(options), prefix, layer);
}

SharedExpert::SharedExpert(const SharedExpertOptions& options, ParameterStore& store, const std::string& prefix)
    : mlp_(mlp_options(options), store, prefix) {}

}  // namespace moetrain::model
