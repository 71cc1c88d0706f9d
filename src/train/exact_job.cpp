// defines: a job's exact-lane admission and its pipeline wire check.
#include "train/exact_job.h"

#include "exact/wire_checks.h"

namespace moetrain::train {

pipeline::Partition job_partition(const io::JobConfig& config, const model::ModelConfig& model_config, int pp) {
  return config.parallel.pp_cuts.empty() ? pipeline::partition_balanced(model_config, pp)
                                         : pipeline::partition_from_cuts(model_config, pp, config.parallel.pp_cuts);
}

exact::AdmissionReport admit_exact_for_job(const io::JobConfig& config, const model::CausalLm& model,
                                           const pipeline::Partition& partition, int64_t ep_size) {
  exact::ExactDeclaration declaration;
  // The CPU's exact program: f32 math within a layer, the residual rounded to bf16 at every layer
  // boundary, fp32 masters: "bf16 compute with uniformly fp32 masters" in the contract's terms.
  declaration.compute_dtype = "bf16";
  declaration.wire_dtype = DType::BF16;
  declaration.device = model.device();
  declaration.loss = "cross_entropy";
  declaration.load_balance = config.loss.load_balance;
  declaration.load_balance_coef = config.loss.load_balance_coef;
  declaration.z_loss_coef = config.loss.z_loss_coef;
  declaration.device_balance_coef = config.loss.device_balance_coef;
  // Resolved without the divisibility check: the admission's own rule reports a bad D among every violation.
  declaration.device_balance_groups =
      config.loss.device_balance_groups > 0 ? config.loss.device_balance_groups : ep_size;
  for (const model::ParamSpec& spec : model.params().specs())
    declaration.parameter_dtypes.push_back({spec.name, model.params().param(spec.name).dtype(), spec.fp32_pin});
  return exact::admit_exact(declaration, model.config(), partition);
}

pipeline::WireCheck exact_wire_check(int stage, int64_t hidden, int64_t max_seqlen) {
  return [stage, hidden, max_seqlen](const Tensor& activation, const model::MicroBatch& batch) {
    const int64_t tokens = batch.position_ids.numel();  // a received batch carries metadata, not tokens
    exact::check_wire_tensor(activation, stage, -1, tokens, hidden);
    exact::check_varlen_metadata(batch.cu_seqlens_host, batch.cu_seqlens_host, tokens, max_seqlen, -1);
  };
}

}  // namespace moetrain::train
