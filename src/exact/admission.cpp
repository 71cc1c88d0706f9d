// defines: the exact-lane admission rules and the two-pass admit_exact (see admission.h and docs/design.md section 6).
#include "exact/admission.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"

namespace moetrain::exact {

namespace {

// How many names a list in a message shows before "and N more".
constexpr size_t kMaxNamesShown = 8;

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) text += separator;
    text += items[i];
  }
  return text;
}

std::string join_capped(const std::vector<std::string>& items) {
  if (items.size() <= kMaxNamesShown) return join(items, ", ");
  std::vector<std::string> shown(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(kMaxNamesShown));
  return fmt::format("{} and {} more", join(shown, ", "), items.size() - kMaxNamesShown);
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

std::string stage_str(const pipeline::StageLayers& s) {
  return fmt::format("stage {} (rank {}, layers [{}, {}))", s.stage, s.rank, s.first_layer, s.end_layer);
}

void refuse(std::vector<Violation>& out, std::string rule, std::string declared, std::string found) {
  out.push_back({std::move(rule), std::move(declared), std::move(found)});
}

int num_stages(const pipeline::Partition& p) { return static_cast<int>(p.stages.size()); }

std::string layers_str(const pipeline::StageLayers& s) {
  if (s.num_layers() == 1) return fmt::format("layer {}", s.first_layer);
  return fmt::format("layers {}-{}", s.first_layer, s.end_layer - 1);
}

}  // namespace

std::string Violation::message() const {
  return fmt::format("exact: refused: {}: declared {}, found {}", rule, declared, found);
}

const std::vector<std::string>& certified_fp32_pins() {
  static const std::vector<std::string> pins = {"A_log", "dt_bias"};
  return pins;
}

std::vector<std::string> certified_model_types() {
  std::vector<std::string> types;
  for (const model::Family* family : model::registered_families()) {
    model::ModelConfig probe;
    probe.family = family;
    if (!family->exact_certification(probe).certified) continue;
    for (const std::string& t : family->model_types()) types.push_back(t);
  }
  return types;
}

const std::vector<CertifiedKernel>& cuda_batch_invariant_kernels() {
  static const std::vector<CertifiedKernel> kernels = {
      {"gemm",
       "a layer's forward and input gradient on CUTLASS (one tile configuration, no split-K) when N and K are "
       "multiples "
       "of 8, else a tiled kernel summing K in ascending order; chosen by (N, K) alone"},
      {"grouped_gemm", "CUTLASS or the generic kernels, chosen by (N, K) alone; a row never depends on its group"},
      {"attention",
       "our kernels (tiles from each document's first token, on the tensor cores in bf16 at head dims 64 and 128; a "
       "deterministic backward without atomics), never cuDNN"},
      {"gated_delta", "the sequential scan per document, which generation's prefill and steps run too"},
      {"norm and cross_entropy", "rows summed in a layout fixed by their width, refusing data it does not fit"},
  };
  return kernels;
}

void check_stage_layout(const pipeline::Partition& partition, std::vector<Violation>& out) {
  constexpr const char* rule = "stage layout";
  const int pp = partition.pp;
  if (pp < 1) {
    refuse(out, rule, "pipeline ranks P >= 1", fmt::format("P = {}", pp));
    return;
  }
  if (num_stages(partition) != 2 * pp) {
    refuse(out, rule, fmt::format("2P = {} stages for P = {}", 2 * pp, pp),
           fmt::format("{} stages", partition.stages.size()));
  }
  for (int s = 0; s < num_stages(partition); ++s) {
    const pipeline::StageLayers& st = partition.stages[static_cast<size_t>(s)];
    const int rank = s < pp ? s : 2 * pp - 1 - s;
    if (st.stage != s || st.rank != rank) {
      refuse(out, rule, fmt::format("entry {} to be stage {} on rank {}", s, s, rank),
             fmt::format("stage {} on rank {}", st.stage, st.rank));
    }
  }
}

void check_layer_count(const model::ModelConfig& config, const pipeline::Partition& partition,
                       std::vector<Violation>& out) {
  const int64_t stages = 2 * static_cast<int64_t>(partition.pp);
  if (config.num_hidden_layers < stages) {
    refuse(out, "fewer layers than stages",
           fmt::format("P = {}, so 2P = {} stages of >= 1 decoder layer each", partition.pp, stages),
           fmt::format("{} decoder layers in the model", config.num_hidden_layers));
  }
}

void check_layer_boundaries(const model::ModelConfig& config, const pipeline::Partition& partition,
                            std::vector<Violation>& out) {
  constexpr const char* rule = "cuts on layer boundaries";
  const int64_t L = config.num_hidden_layers;
  if (partition.stages.empty()) {
    refuse(out, rule, fmt::format("stages covering decoder layers [0, {})", L), "no stages");
    return;
  }
  int64_t total = 0;
  for (size_t i = 0; i < partition.stages.size(); ++i) {
    const pipeline::StageLayers& s = partition.stages[i];
    total += std::max<int64_t>(s.num_layers(), 0);
    if (s.num_layers() < 1) {
      refuse(out, rule, fmt::format("stage {} holds >= 1 decoder layer", s.stage),
             fmt::format("{} holding {} layers", stage_str(s), s.num_layers()));
    }
    if (s.first_layer < 0 || s.end_layer > L) {
      refuse(out, rule, fmt::format("stage {} inside decoder layers [0, {})", s.stage, L), stage_str(s));
    }
    if (i > 0 && s.first_layer <= partition.stages[i - 1].first_layer) {
      refuse(out, rule, fmt::format("stages in ascending layer order"),
             fmt::format("{} after {}", stage_str(s), stage_str(partition.stages[i - 1])));
    }
  }
  const pipeline::StageLayers& first = partition.stages.front();
  const pipeline::StageLayers& last = partition.stages.back();
  if (first.first_layer != 0) {
    refuse(out, rule, "the first stage starts at layer 0", stage_str(first));
  }
  if (last.end_layer != L) {
    refuse(out, rule, fmt::format("the last stage ends at layer {} (the model's count)", L), stage_str(last));
  }
  if (total != L) {
    refuse(out, rule, fmt::format("each of the {} decoder layers held exactly once", L),
           fmt::format("the stages hold {} layers in all", total));
  }
}

void check_global_layer_identity(const pipeline::Partition& partition, std::vector<Violation>& out) {
  for (size_t i = 1; i < partition.stages.size(); ++i) {
    const pipeline::StageLayers& prev = partition.stages[i - 1];
    const pipeline::StageLayers& s = partition.stages[i];
    if (s.first_layer != prev.end_layer) {
      refuse(
          out, "global layer identity",
          fmt::format("stage {} starts at global layer {} (where stage {} ends)", s.stage, prev.end_layer, prev.stage),
          stage_str(s));
    }
  }
}

void check_embedding_placement(const pipeline::Partition& partition, std::vector<Violation>& out) {
  constexpr const char* rule = "embedding on the first stage";
  for (size_t i = 0; i < partition.stages.size(); ++i) {
    const pipeline::StageLayers& s = partition.stages[i];
    if (i == 0 && !s.has_embedding) {
      refuse(out, rule, "the token embedding on stage 0", fmt::format("{} without it", stage_str(s)));
    }
    if (i > 0 && s.has_embedding) {
      refuse(out, rule, "the token embedding on stage 0 only", fmt::format("it also on {}", stage_str(s)));
    }
  }
}

void check_head_placement(const pipeline::Partition& partition, std::vector<Violation>& out) {
  constexpr const char* rule = "final norm and head on the last stage";
  if (partition.stages.empty()) return;  // check_layer_boundaries refuses an empty partition
  const size_t last = partition.stages.size() - 1;
  std::vector<std::string> norm_on;
  std::vector<std::string> head_on;
  for (const pipeline::StageLayers& s : partition.stages) {
    if (s.has_final_norm) norm_on.push_back(fmt::format("stage {}", s.stage));
    if (s.has_head) head_on.push_back(fmt::format("stage {}", s.stage));
  }
  const pipeline::StageLayers& end = partition.stages[last];
  const bool only_last = norm_on.size() == 1 && head_on.size() == 1 && end.has_final_norm && end.has_head;
  if (!only_last) {
    refuse(out, rule, fmt::format("the final norm and the head together on stage {} (the last) only", end.stage),
           fmt::format("the final norm on {} and the head on {}", norm_on.empty() ? "no stage" : join(norm_on, ", "),
                       head_on.empty() ? "no stage" : join(head_on, ", ")));
  }
}

void check_model_family(const ExactDeclaration& declaration, const model::ModelConfig& config,
                        std::vector<Violation>& out) {
  constexpr const char* rule = "model family";
  const std::string certified = join(certified_model_types(), ", ");
  const model::ExactCertification cert = config.family != nullptr
                                             ? config.family->exact_certification(config)
                                             : model::ExactCertification{false, "the config names no family"};
  if (!cert.certified) {
    refuse(out, rule, fmt::format("a family certified for exact mode ({})", certified),
           fmt::format("'{}': {}", config.model_type,
                       cert.reason.empty() ? "its layers have no batch-invariant exact program yet, so exact mode "
                                             "cannot promise its bytes"
                                           : cert.reason));
  }
  if (!declaration.model_type.empty() && declaration.model_type != config.model_type) {
    refuse(out, rule, fmt::format("'{}'", declaration.model_type),
           fmt::format("'{}' in the model's config.json", config.model_type));
  }
}

void check_compute_dtype(const ExactDeclaration& declaration, std::vector<Violation>& out) {
  if (declaration.compute_dtype != "bf16") {
    refuse(out, "compute dtype", fmt::format("'{}'", declaration.compute_dtype),
           "exact lanes certified for bf16 compute only");
  }
}

void check_wire_dtype(const ExactDeclaration& declaration, std::vector<Violation>& out) {
  if (declaration.wire_dtype != DType::BF16) {
    refuse(out, "wire dtype", std::string(dtype_name(declaration.wire_dtype)),
           "exact lanes cut only where the residual stream is materialised in bf16");
  }
}

void check_parameter_dtypes(const ExactDeclaration& declaration, std::vector<Violation>& out) {
  std::vector<std::string> uncertified_pins;
  for (const std::string& pin : declaration.fp32_pins) {
    if (!contains(certified_fp32_pins(), pin)) uncertified_pins.push_back(fmt::format("'{}'", pin));
  }
  if (!uncertified_pins.empty()) {
    refuse(out, "fp32 pins", fmt::format("fp32 pins {}", join(uncertified_pins, ", ")),
           fmt::format("only {} certified as fp32 pins", join(certified_fp32_pins(), ", ")));
  }

  constexpr const char* rule = "parameter dtypes";
  const std::vector<ParamDType>& params = declaration.parameter_dtypes;
  if (params.empty()) {
    refuse(out, rule,
           fmt::format("{} compute with bf16 parameters (or uniformly f32 masters)", declaration.compute_dtype),
           "no parameter dtypes");
    return;
  }
  const bool all_f32 =
      std::all_of(params.begin(), params.end(), [](const ParamDType& p) { return p.dtype == DType::F32; });
  if (all_f32) return;  // fp32 masters under declared bf16 compute
  std::vector<std::string> bad;
  for (const ParamDType& p : params) {
    if (p.dtype == DType::BF16) continue;
    // The family names the pin of each parameter it keeps f32 (ParamSpec::fp32_pin); no name is parsed here.
    const bool pinned = p.dtype == DType::F32 && !p.fp32_pin.empty() && contains(declaration.fp32_pins, p.fp32_pin) &&
                        contains(certified_fp32_pins(), p.fp32_pin);
    if (!pinned) bad.push_back(fmt::format("{} {}", p.name, dtype_name(p.dtype)));
  }
  if (!bad.empty()) {
    refuse(out, rule,
           fmt::format("{} compute: every parameter bf16 except the fp32 pins ({}), or every parameter f32",
                       declaration.compute_dtype, join(declaration.fp32_pins, ", ")),
           fmt::format("{} of {} parameters otherwise: {}", bad.size(), params.size(), join_capped(bad)));
  }
}

void check_losses(const ExactDeclaration& declaration, std::vector<Violation>& out) {
  if (declaration.loss != "cross_entropy") {
    refuse(out, "loss", fmt::format("'{}'", declaration.loss),
           "a pipeline-parallel path only for 'cross_entropy' (token-weighted); other losses are refused, never "
           "substituted");
  }
  constexpr const char* rule = "load-balance loss";
  const std::string& variant = declaration.load_balance;
  if (variant != "micro_batch" && variant != "sequence" && variant != "global_batch") {
    refuse(out, rule, fmt::format("variant '{}'", variant), "known variants micro_batch, sequence, global_batch");
  } else if (variant == "global_batch" && declaration.load_balance_coef != 0.0) {
    refuse(out, rule, fmt::format("variant 'global_batch' with coefficient {}", declaration.load_balance_coef),
           "no pipeline path: its expert counts accumulate over the step's earlier micro-batches in the order the "
           "schedule runs them, so a micro-batch's value depends on the others; use 'micro_batch' or 'sequence', "
           "or a coefficient of 0");
  }
}

void check_device_balance(const ExactDeclaration& declaration, const model::ModelConfig& config,
                          std::vector<Violation>& out) {
  constexpr const char* rule = "device-balance loss";
  const double coef = declaration.device_balance_coef;
  if (!std::isfinite(coef) || coef < 0.0) {
    refuse(out, rule, fmt::format("coefficient {}", coef), "a finite coefficient >= 0 (0 turns the loss off)");
  } else if (coef > 0.0 &&
             (declaration.device_balance_groups < 1 || config.num_experts % declaration.device_balance_groups != 0)) {
    refuse(out, rule, fmt::format("{} device groups with coefficient {}", declaration.device_balance_groups, coef),
           fmt::format("{} experts, which groups of equal size cannot cover; use a divisor of {} "
                       "(loss.device_balance_groups)",
                       config.num_experts, config.num_experts));
  }
}

std::vector<Violation> exact_violations(const ExactDeclaration& declaration, const model::ModelConfig& config,
                                        const pipeline::Partition& partition) {
  std::vector<Violation> out;
  check_stage_layout(partition, out);
  check_layer_count(config, partition, out);
  check_layer_boundaries(config, partition, out);
  check_global_layer_identity(partition, out);
  check_embedding_placement(partition, out);
  check_head_placement(partition, out);
  check_model_family(declaration, config, out);
  check_compute_dtype(declaration, out);
  check_wire_dtype(declaration, out);
  check_parameter_dtypes(declaration, out);
  check_losses(declaration, out);
  check_device_balance(declaration, config, out);
  return out;
}

AdmissionReport admit_exact(const ExactDeclaration& declaration, const model::ModelConfig& config,
                            const pipeline::Partition& partition) {
  // Pass 1: everything, for every stage, before anything is marked.
  const std::vector<Violation> violations = exact_violations(declaration, config, partition);
  if (!violations.empty()) {
    std::vector<std::string> lines;
    for (const Violation& v : violations) lines.push_back(v.message());
    MT_FAIL("exact: admission refused with {} violation(s); no stage was marked exact:\n{}\n", violations.size(),
            join(lines, "\n"));
  }
  // Pass 2: mark and log, one line per stage.
  std::string kernels;
  if (declaration.device.is_cuda()) {
    std::vector<std::string> names;
    for (const CertifiedKernel& k : cuda_batch_invariant_kernels()) names.push_back(k.kernel);
    kernels = fmt::format(" ({})", join(names, ", "));
  }
  AdmissionReport report;
  for (const pipeline::StageLayers& s : partition.stages) {
    StageAdmission stage;
    stage.stage = s.stage;
    stage.rank = s.rank;
    stage.first_layer = s.first_layer;
    stage.end_layer = s.end_layer;
    stage.log_line =
        fmt::format("exact: stage {} (rank {}, {}) engaged: {} wire, batch-invariant kernels on {}{}", s.stage, s.rank,
                    layers_str(s), dtype_name(declaration.wire_dtype), declaration.device.str(), kernels);
    log_info("{}", stage.log_line);
    report.stages.push_back(std::move(stage));
  }
  return report;
}

}  // namespace moetrain::exact
