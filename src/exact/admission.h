// defines: the exact-lane admission contract of docs/design.md section 6, checked before anything runs. Pass 1 runs
// every rule on every stage and collects ALL violations (one Error lists them); only when none is found does pass 2
// mark the stages and log one line per stage. Each rule is its own function so each has its own refusal test.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "model/family.h"
#include "model/model_config.h"
#include "pipeline/partition.h"

namespace moetrain::exact {

// One parameter as the engine holds it: its internal name (for messages), its stored dtype, and the fp32 pin its
// family declares for it (model::ParamSpec::fp32_pin; empty: none).
struct ParamDType {
  std::string name;
  DType dtype = DType::F32;
  std::string fp32_pin;
};

// What the job declares for exact mode (exact.enabled = true), plus what was found on the loaded parameters.
struct ExactDeclaration {
  std::string model_type;              // the family the job declares ("qwen3", ...); empty: the config's own
  std::string compute_dtype = "bf16";  // exact lanes certify bf16 compute only
  DType wire_dtype = DType::BF16;      // the inter-stage activation tensor
  Device device = Device::cpu();
  std::string loss = "cross_entropy";        // token-weighted cross-entropy: the only main loss with a pipeline path
  std::string load_balance = "micro_batch";  // micro_batch | sequence | global_batch (io::LossSection)
  double load_balance_coef = 0.0;
  double z_loss_coef = 0.0;
  double device_balance_coef = 0.0;          // DeepSeek-V2's device-level balance loss (io::LossSection)
  int64_t device_balance_groups = 1;         // its groups D as the run resolves them (loss.device_balance_groups or ep)
  std::vector<ParamDType> parameter_dtypes;  // found: every parameter's stored dtype
  std::vector<std::string> fp32_pins = {"A_log", "dt_bias"};  // the pins allowed to stay f32 under bf16
};

// One broken rule: rendered "exact: refused: <rule>: declared <declared>, found <found>".
struct Violation {
  std::string rule;
  std::string declared;
  std::string found;
  std::string message() const;
};

// A stage that pass 2 marked exact, with the line it logged.
struct StageAdmission {
  int stage = 0;
  int rank = 0;
  int64_t first_layer = 0;
  int64_t end_layer = 0;
  std::string log_line;  // "exact: stage 2 (rank 1, layers 4-5) engaged: bf16 wire, batch-invariant kernels on cpu"
};

struct AdmissionReport {
  std::vector<StageAdmission> stages;  // in stage order; empty until every check passed
  bool empty() const { return stages.empty(); }
};

// The fp32 pins exact mode certifies (Gated DeltaNet A_log, dt_bias); a declared pin outside it is refused.
const std::vector<std::string>& certified_fp32_pins();
// The model types certified for exact mode: those whose family certifies itself (model::Family).
std::vector<std::string> certified_model_types();

// The CUDA kernels exact mode runs there, named in each stage's log line on CUDA: model::CausalLm::set_exact puts the
// device's stream under KernelPolicy::BatchInvariant (core/device.h), and each op then runs the variant listed here
// (or refuses arguments it has none for). The CPU's kernels are batch-invariant by construction.
struct CertifiedKernel {
  std::string kernel;   // op family, e.g. "gemm"
  std::string variant;  // what runs, and why a token's bytes do not depend on the batch
};
const std::vector<CertifiedKernel>& cuda_batch_invariant_kernels();

// The rules. Each appends its violations to `out` (never throws on a violation) and is named as in its messages.
// "stage layout": 2P stages with P >= 1, stage s at index s, run by rank s (s < P) or 2P - 1 - s.
void check_stage_layout(const pipeline::Partition& partition, std::vector<Violation>& out);
// "fewer layers than stages": the model has >= 2P decoder layers.
void check_layer_count(const model::ModelConfig& config, const pipeline::Partition& partition,
                       std::vector<Violation>& out);
// "cuts on layer boundaries": every stage holds >= 1 layer inside [0, L), stages ascend, the first starts at 0, the
// last ends at L, and the stages hold L layers in all (each layer exactly once).
void check_layer_boundaries(const model::ModelConfig& config, const pipeline::Partition& partition,
                            std::vector<Violation>& out);
// "global layer identity": stage s starts where stage s - 1 ends (layers keep their global indices).
void check_global_layer_identity(const pipeline::Partition& partition, std::vector<Violation>& out);
// "embedding on the first stage": stage 0 holds the embedding and no other stage does.
void check_embedding_placement(const pipeline::Partition& partition, std::vector<Violation>& out);
// "final norm and head on the last stage": both on the last stage, together, and on no other.
void check_head_placement(const pipeline::Partition& partition, std::vector<Violation>& out);
// "model family": the config's model type is certified and matches the declared one.
void check_model_family(const ExactDeclaration& declaration, const model::ModelConfig& config,
                        std::vector<Violation>& out);
// "compute dtype": bf16. "wire dtype": bf16.
void check_compute_dtype(const ExactDeclaration& declaration, std::vector<Violation>& out);
void check_wire_dtype(const ExactDeclaration& declaration, std::vector<Violation>& out);
// "fp32 pins": the declared allow-list is inside certified_fp32_pins().
// "parameter dtypes": every parameter bf16 except allow-listed pins (which may be f32), or every parameter f32
// (fp32 masters under bf16 compute); no parameters at all is refused too.
void check_parameter_dtypes(const ExactDeclaration& declaration, std::vector<Violation>& out);
// "loss": token-weighted cross_entropy. "load-balance loss": micro_batch and sequence are computed from one
// micro-batch alone (pipeline-safe); global_batch with a non-zero coefficient is refused. The z-loss is per token.
void check_losses(const ExactDeclaration& declaration, std::vector<Violation>& out);
// "device-balance loss": computed from one micro-batch alone (pipeline-safe) when its coefficient is finite and
// >= 0 and, when it is > 0, its D >= 1 groups divide the config's experts; anything else is refused.
void check_device_balance(const ExactDeclaration& declaration, const model::ModelConfig& config,
                          std::vector<Violation>& out);

// Pass 1: every rule on every stage; the list of all violations (empty: admissible).
std::vector<Violation> exact_violations(const ExactDeclaration& declaration, const model::ModelConfig& config,
                                        const pipeline::Partition& partition);

// Pass 1, then (only when it found nothing) pass 2: marks each stage and logs its line at info level. On any
// violation throws one moetrain::Error listing every violation, one per line, and marks and logs nothing.
AdmissionReport admit_exact(const ExactDeclaration& declaration, const model::ModelConfig& config,
                            const pipeline::Partition& partition);

}  // namespace moetrain::exact
