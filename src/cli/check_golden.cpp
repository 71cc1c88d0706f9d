// defines: the check-golden command: the batch, packed and trajectory cases of a reference dump, run through
// the engine and compared tensor by tensor (relative error ||ours - ref|| / ||ref||); check_golden_judge.h
// holds the judgement: fp32 thresholds, or in bf16 transformers' own bf16 error as the yardstick; after near-tie
// routing flips in bf16, a second pass with every router selecting from the reference's router logits.
#include "cli/check_golden.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/check_golden_judge.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "ops/cuda/runtime.h"
#include "ops/optim.h"
#include "pipeline/plain_executor.h"
#include "train/optimizer.h"

namespace moetrain::cli {

namespace {

using golden::judge_bf16;
using golden::Judged;
using golden::relative_error;
using golden::Report;
using golden::RoutingCheck;
using golden::Thresholds;

const std::string kBf16Rule = fmt::format("{} x theirs + {:.1e}", golden::kBf16Factor, golden::kBf16Floor);

Tensor scalar_tensor(double value) { return Tensor::from_vector<double>({value}, {1}); }

// Compares every parameter (or gradient) with the reference's `prefix`<name>. The reference names
// fused expert tensors as transformers holds them in memory; those are compared whole.
std::vector<std::pair<std::string, double>> compare_named(const model::ParameterStore& store, bool of_grads,
                                                          const io::SafetensorsReader& ref, const std::string& prefix,
                                                          Report& report, const std::string& label) {
  const auto ours =
      store.export_hf_runtime(of_grads, [&](const std::string& fused) { return ref.contains(prefix + fused); });
  std::vector<std::pair<std::string, double>> errors;
  std::set<std::string> seen;
  for (const auto& [name, tensor] : ours) {
    seen.insert(name);
    if (!ref.contains(prefix + name)) {
      report.line(false, fmt::format("{}: the reference has no '{}'", label, prefix + name));
      continue;
    }
    errors.emplace_back(name, relative_error(tensor, ref.tensor(prefix + name)));
  }
  for (const std::string& name : ref.names()) {
    if (name.rfind(prefix, 0) == 0 && !seen.count(name.substr(prefix.size()))) {
      report.line(false, fmt::format("{}: the engine has no parameter for reference '{}'", label, name));
    }
  }
  return errors;
}

// What one forward-backward pass of a case measured against the reference.
struct PassResult {
  double logits_error = 0.0, loss_error = 0.0;
  int64_t num_targets = 0;
  std::vector<Tensor> router_logits;  // ours, per MoE layer
  std::vector<std::pair<std::string, double>> grad_errors;
};

PassResult run_pass(Report& report, const std::string& label, const std::string& prefix, model::CausalLm& model,
                    const model::MicroBatch& batch, const io::SafetensorsReader& ref) {
  model.params().zero_grads();
  model::ForwardObservation observed;
  const model::StepLoss step = pipeline::forward_backward(model, {batch}, 0, &observed);
  PassResult r;
  r.logits_error = relative_error(observed.logits[0], ref.tensor(prefix + "logits"));
  r.loss_error = relative_error(scalar_tensor(step.loss), ref.tensor(prefix + "loss"));
  r.num_targets = step.num_targets;
  r.router_logits = observed.router_logits[0];
  r.grad_errors = compare_named(model.params(), true, ref, prefix + "grad.", report, label);
  return r;
}

// The groups a bf16 case is judged in, each tensor against its own bound.
struct Bf16Groups {
  std::vector<Judged> logits, loss, router_logits, grads;
};

// A pass's errors against transformers' own bf16 errors: per gradient bf16ref.<prefix>grad.<name>; the router logits
// (the dump has no bf16 router logits) against that of the logits, which they are upstream of on the same residual
// stream through the same kind of bf16 matmul.
Bf16Groups judge_pass(const PassResult& pass, const std::vector<Tensor>& reference_router, const std::string& prefix,
                      const io::SafetensorsReader& ref) {
  Bf16Groups g;
  const double theirs_logits = golden::theirs_error(ref, prefix + "logits");
  g.logits.push_back(judge_bf16(prefix + "logits", pass.logits_error, theirs_logits));
  g.loss.push_back(judge_bf16(prefix + "loss", pass.loss_error, golden::theirs_loss_error(ref, prefix)));
  for (size_t i = 0; i < reference_router.size(); ++i) {
    g.router_logits.push_back(judge_bf16(fmt::format("{}router_logits.{}", prefix, i),
                                         relative_error(pass.router_logits.at(i), reference_router[i]), theirs_logits));
  }
  for (const auto& [name, error] : pass.grad_errors) {
    g.grads.push_back(judge_bf16(name, error, golden::theirs_error(ref, prefix + "grad." + name)));
  }
  return g;
}

// Whether every tensor of every group is within its bound.
bool within(const Bf16Groups& g) {
  for (const auto* group : {&g.logits, &g.loss, &g.router_logits, &g.grads}) {
    if (!std::all_of(group->begin(), group->end(), [](const Judged& j) { return j.within(); })) return false;
  }
  return true;
}

// One bf16 group of the free pass: when a pinned pass ran, the tensors it holds within their bound are excused
// (check_golden_judge.h says when and why); without one, every tensor is judged.
void report_free_group(Report& report, const std::string& group, const std::vector<Judged>& free,
                       const std::vector<Judged>* pinned, bool flips_explained, const std::string& yardstick,
                       const std::string& rule) {
  if (pinned == nullptr) {
    report.judged(group, free, yardstick, rule);
    return;
  }
  const golden::Excusal excusal = golden::excuse_by_pinned_pass(free, *pinned, flips_explained);
  const std::string excused = golden::excused_line(group + " excused", excusal);
  if (!excused.empty()) report.info(excused);
  if (!excusal.kept.empty()) report.judged(group, excusal.kept, yardstick, rule);
}

// Before a step of a rounding-ensemble member: every fp32 master w becomes w (1 + u r), r uniform in [-1, 1) from
// the member's own stream per (step, tensor), rounded back to fp32 (check_golden_judge.h says which u and why).
void perturb_by_one_rounding(model::ParameterStore& params, double unit, uint64_t member, int64_t step) {
  const std::vector<Tensor> masters = params.all_params();
  for (size_t i = 0; i < masters.size(); ++i) {
    const Tensor& master = masters[i];
    expect_dtype(master, DType::F32, "check-golden: rounding ensemble: master weight");
    Tensor host = master.device().is_cpu() ? master : master.to(Device::cpu());
    Rng rng = Rng::for_key(member, fmt::format("step {} {}", step, params.specs()[i].name));
    float* values = host.data<float>();
    for (int64_t j = 0; j < host.numel(); ++j) {
      const double factor = 1.0 + unit * (2.0 * rng.uniform() - 1.0);
      values[j] = static_cast<float>(static_cast<double>(values[j]) * factor);
    }
    if (!master.device().is_cpu()) Tensor(master).copy_from(host);
  }
  params.refresh_compute_weights();
}

// Every master weight of a model, kept so that a rounding ensemble's perturbation can be undone exactly.
class KeptWeights {
 public:
  explicit KeptWeights(model::ParameterStore& params) : params_(params) {
    for (const Tensor& master : params.all_params()) kept_.push_back(master.clone());
  }
  void put_back() {
    const std::vector<Tensor> masters = params_.all_params();
    for (size_t i = 0; i < masters.size(); ++i) Tensor(masters[i]).copy_from(kept_[i]);
    params_.refresh_compute_weights();
  }

 private:
  model::ParameterStore& params_;
  std::vector<Tensor> kept_;
};

// The router logits of one micro-batch, per MoE layer [T, E], from a forward pass that keeps nothing else.
std::vector<Tensor> observed_router_logits(model::CausalLm& model, const model::MicroBatch& batch) {
  model::ForwardObservation seen;
  seen.keep_logits = false;
  pipeline::forward_only(model, {batch}, &seen);
  return seen.router_logits.at(0);
}

// The router logits of `batch` after one rounding of relative size `unit` of every weight, once per member of a
// rounding ensemble (members x MoE layers); the weights are put back as they were after each.
std::vector<std::vector<Tensor>> router_logits_after_roundings(model::CausalLm& model, const model::MicroBatch& batch,
                                                               double unit) {
  KeptWeights kept(model.params());
  std::vector<std::vector<Tensor>> members;
  for (int member = 1; member <= golden::kEnsembleMembers; ++member) {
    perturb_by_one_rounding(model.params(), unit, static_cast<uint64_t>(member), 0);
    members.push_back(observed_router_logits(model, batch));
    kept.put_back();
  }
  return members;
}

// Reference router logits (the dump's, f32 or f64 on the CPU, or our f32 path's) as f32 on `device`, for
// MicroBatch::pinned_routing.
std::vector<Tensor> router_logits_for_pinning(const std::vector<Tensor>& reference, Device device) {
  std::vector<Tensor> out;
  for (const Tensor& t : reference) out.push_back((t.dtype() == DType::F32 ? t : t.to(DType::F32)).to(device));
  return out;
}

// What a bf16 case's rounding ensemble measured (check_golden_judge.h): per judged tensor its spread, and every
// member's router logits, members x MoE layers (how far one bf16 rounding of the weights moves each token, for the
// near-tie rule).
struct CaseSpreads {
  std::map<std::string, double> spread;
  std::vector<std::vector<Tensor>> member_router_logits;
};

// kEnsembleMembers forward-backward passes of `batch` through the f32 model, each with every weight moved by one
// rounding of relative size `unit` (bf16's, or fp32's) and the routing pinned to `reference_router` (where there is
// one); the weights are put back after. The quantities carry the names the groups judge them by.
CaseSpreads measure_case_spreads(model::CausalLm& f32_model, const model::MicroBatch& batch,
                                 const io::SafetensorsReader& ref, const std::string& prefix,
                                 const std::vector<Tensor>& reference_router, double unit) {
  model::ParameterStore& params = f32_model.params();
  KeptWeights kept(params);
  const std::vector<Tensor> pinned = router_logits_for_pinning(reference_router, f32_model.device());
  model::MicroBatch member_batch = batch;
  if (!pinned.empty()) member_batch.pinned_routing = &pinned;
  const auto in_reference = [&](const std::string& fused) { return ref.contains(prefix + "grad." + fused); };
  golden::EnsembleStats ensemble;
  // Name -> the reference tensor its spread is relative to (a gradient the dump lacks is reported elsewhere).
  std::map<std::string, Tensor> references{{prefix + "logits", ref.tensor(prefix + "logits")},
                                           {prefix + "loss", ref.tensor(prefix + "loss")}};
  for (size_t i = 0; i < reference_router.size(); ++i) {
    references.emplace(fmt::format("{}router_logits.{}", prefix, i), reference_router[i]);
  }
  CaseSpreads out;
  for (int member = 1; member <= golden::kEnsembleMembers; ++member) {
    perturb_by_one_rounding(params, unit, static_cast<uint64_t>(member), 0);
    params.zero_grads();
    model::ForwardObservation seen;
    const model::StepLoss step = pipeline::forward_backward(f32_model, {member_batch}, 0, &seen);
    ensemble.add(prefix + "logits", seen.logits.at(0));
    ensemble.add(prefix + "loss", scalar_tensor(step.loss));
    const std::vector<Tensor>& router = seen.router_logits.at(0);
    for (size_t i = 0; i < router.size(); ++i) ensemble.add(fmt::format("{}router_logits.{}", prefix, i), router[i]);
    for (const auto& [name, grad] : params.export_hf_runtime(true, in_reference)) {
      ensemble.add(name, grad);
      if (member == 1 && ref.contains(prefix + "grad." + name)) {
        references.emplace(name, ref.tensor(prefix + "grad." + name));
      }
    }
    out.member_router_logits.push_back(router);
    kept.put_back();
  }
  for (const auto& [name, reference] : references)
    out.spread[name] = ensemble.center_and_spread(name, reference).second;
  return out;
}

// One judged tensor's bound widened by the spread the ensemble measured for it (check_golden_judge.h).
void widen(Judged& j, const CaseSpreads& spreads) {
  const auto it = spreads.spread.find(j.name);
  MT_CHECK(it != spreads.spread.end(), "check-golden: the rounding ensemble measured no spread of '{}'", j.name);
  golden::widen_by_spread(j, it->second);
}

// Every bound of the groups widened by its tensor's spread under bf16 rounding.
void widen(Bf16Groups& g, const CaseSpreads& spreads) {
  for (auto* group : {&g.logits, &g.loss, &g.router_logits, &g.grads}) {
    for (Judged& j : *group) widen(j, spreads);
  }
}

// One fp32 group of a batch or packed case: its tensors' errors and the threshold they are held to.
struct Fp32Group {
  std::string name;
  std::vector<std::pair<std::string, double>> errors;
  double threshold = 0.0;
};

// The fp32 groups of a batch or packed case: each against its threshold, or where a tensor passes one, every tensor
// against its threshold plus kEnsembleSpreads spreads of an fp32 rounding ensemble of our own path
// (check_golden_judge.h): a gradient that sums many terms which nearly cancel (Qwen3.5's gate and embedding
// gradients) moves by up to 1e-4 of itself under one fp32 rounding of the weights, in the reference's run as in ours.
void judge_fp32_groups(Report& report, const std::string& label, const std::string& prefix, model::CausalLm& model,
                       const model::MicroBatch& batch, const io::SafetensorsReader& ref,
                       const std::vector<Tensor>& reference_router, const std::vector<Fp32Group>& groups) {
  const bool over = std::any_of(groups.begin(), groups.end(), [](const Fp32Group& g) {
    return std::any_of(g.errors.begin(), g.errors.end(), [&](const auto& e) { return !(e.second <= g.threshold); });
  });
  if (!over) {
    for (const Fp32Group& g : groups) report.group(g.name, g.errors, g.threshold);
    return;
  }
  const CaseSpreads spreads =
      measure_case_spreads(model, batch, ref, prefix, reference_router, golden::kUnitRoundoffF32);
  report.info(
      fmt::format("{:<28} over an fp32 threshold: bounds widened by {} spreads of a rounding ensemble of {} "
                  "runs of ours, each weight moved by one fp32 rounding (u = 2^-24){}",
                  label, golden::kEnsembleSpreads, golden::kEnsembleMembers,
                  reference_router.empty() ? "" : ", routing pinned to the reference's"));
  for (const Fp32Group& g : groups) {
    std::vector<Judged> judged;
    for (const auto& [name, error] : g.errors) {
      Judged j{name, error, g.threshold, g.threshold};
      widen(j, spreads);
      judged.push_back(j);
    }
    report.judged(g.name, judged, "threshold", fmt::format("fp32 threshold + {} x spread", golden::kEnsembleSpreads));
  }
}

// An fp32 case whose every top-k flip is a rounding near-tie (check_golden_judge.h): judged as bf16 judges one, with
// the fp32 thresholds as bounds. The case runs again with every router selecting from the reference's router
// logits; that pinned pass is held to the thresholds with nothing set aside, and a tensor of the free pass over its
// threshold is excused only where the pinned pass holds it.
void judge_fp32_after_near_ties(Report& report, const std::string& label, const std::string& prefix,
                                model::CausalLm& model, const model::MicroBatch& batch,
                                const io::SafetensorsReader& ref, const PassResult& free,
                                const std::vector<Tensor>& reference, const std::string& source,
                                const RoutingCheck& routing) {
  const Thresholds th;
  const auto groups = [&](const PassResult& pass) {
    Bf16Groups g;
    g.logits.push_back({prefix + "logits", pass.logits_error, th.logits, th.logits});
    g.loss.push_back({prefix + "loss", pass.loss_error, th.loss, th.loss});
    for (size_t i = 0; i < reference.size(); ++i) {
      const double error = relative_error(pass.router_logits.at(i), reference[i]);
      g.router_logits.push_back(
          {fmt::format("{}router_logits.{}", prefix, i), error, th.router_logits, th.router_logits});
    }
    for (const auto& [name, error] : pass.grad_errors) g.grads.push_back({name, error, th.grads, th.grads});
    return g;
  };
  const Bf16Groups ours = groups(free);
  const std::vector<Tensor> pinned_logits = router_logits_for_pinning(reference, model.device());
  model::MicroBatch pinned_batch = batch;
  pinned_batch.pinned_routing = &pinned_logits;
  const Bf16Groups pinned = groups(run_pass(report, label + "/pinned", prefix, model, pinned_batch, ref));
  const std::string rule = "the fp32 threshold";
  const std::string how = rule + " (every router selecting from the reference's router logits" + source + ")";
  report.line(routing.ok(), fmt::format("{:<28} {}{}", label + "/routing", routing.summary(), source));
  report.judged(label + "/pinned/logits", pinned.logits, "threshold", how);
  report.judged(label + "/pinned/loss", pinned.loss, "threshold", rule);
  report.judged(label + "/pinned/router_logits", pinned.router_logits, "threshold", rule);
  report.judged(label + "/pinned/grads", pinned.grads, "threshold", rule);
  report_free_group(report, label + "/logits", ours.logits, &pinned.logits, true, "threshold", rule);
  report_free_group(report, label + "/loss", ours.loss, &pinned.loss, true, "threshold", rule);
  report_free_group(report, label + "/router_logits", ours.router_logits, &pinned.router_logits, true, "threshold",
                    rule);
  report_free_group(report, label + "/grads", ours.grads, &pinned.grads, true, "threshold", rule);
}

// `f32_model`: in bf16, the same model in f32 on the same device. It stands in for the reference's routing where the
// dump has no router logits (the packed case; the f32 check holds it to transformers' router logits within 1e-5),
// and runs the rounding ensemble.
void run_forward_backward_case(Report& report, const std::string& label, const std::string& prefix,
                               model::CausalLm& model, model::CausalLm* f32_model, const model::MicroBatch& batch,
                               const io::SafetensorsReader& ref, bool bf16, bool pin_always) {
  const Thresholds th;
  const PassResult free = run_pass(report, label, prefix, model, batch, ref);
  const std::string logits_key = prefix + "logits", loss_key = prefix + "loss";

  // The reference's router logits: the dump's (the batch case, when transformers returns them for the family), or
  // our f32 path's (the packed case, or a family without them; bf16 only).
  std::vector<Tensor> reference;
  std::string source;
  const bool dumped_router_logits = prefix.empty() && ref.contains("router_logits.0");
  if (model.config().is_moe() && dumped_router_logits) {
    // The routing check reads rows of the reference's shape; one that differs from ours (a header rewritten from
    // [96, 8] to [768, 1] keeps the element count) is refused before it is read.
    for (size_t i = 0; i < free.router_logits.size(); ++i) {
      const std::string key = fmt::format("router_logits.{}", i);
      MT_CHECK(ref.contains(key), "check-golden: the reference {} has router_logits.0 but no '{}' ({} MoE layers)",
               ref.path(), key, free.router_logits.size());
      Tensor tensor = ref.tensor(key);
      MT_CHECK(tensor.shape() == free.router_logits[i].shape(),
               "check-golden: the reference {} has '{}' of shape {}, expected {} (tokens x experts, as the model "
               "computes them)",
               ref.path(), key, shape_str(tensor.shape()), shape_str(free.router_logits[i].shape()));
      reference.push_back(std::move(tensor));
    }
  } else if (model.config().is_moe() && f32_model != nullptr) {
    model::ForwardObservation f32;
    pipeline::forward_only(*f32_model, {batch}, &f32);
    reference = f32.router_logits[0];
    source = " (against our f32 path: the dump has no router logits here)";
  } else if (model.config().is_moe() && prefix.empty()) {
    report.info(
        fmt::format("{:<28} the dump has no router logits for this family: routing is judged through the "
                    "logits and gradients",
                    label + "/router_logits"));
  }
  // Near ties are explained in f32 too: the reference's own f32 rounding can exceed a top-k margin in a model that
  // amplifies rounding (Qwen3.5-MoE); sigma is then our f32 error, so only margins of that size are excused.
  RoutingCheck routing;
  routing.explain_near_ties = true;
  std::vector<std::vector<Tensor>> after_rounding;
  if (!reference.empty()) {
    routing.add_pass(reference, free.router_logits, model.config().num_experts_per_tok, batch.cu_seqlens_host);
    if (!bf16 && !routing.ok()) {
      // Flips our f32 error does not explain: measure how far one fp32 rounding of the weights moves each token.
      after_rounding = router_logits_after_roundings(model, batch, golden::kUnitRoundoffF32);
      routing = RoutingCheck{};
      routing.explain_near_ties = true;
      routing.after_rounding = &after_rounding;
      routing.add_pass(reference, free.router_logits, model.config().num_experts_per_tok, batch.cu_seqlens_host);
    }
  }
  if (ref.contains(prefix + "num_tokens")) {
    const int64_t ref_count = ref.tensor(prefix + "num_tokens").to(DType::I64).item<int64_t>();
    report.line(ref_count == free.num_targets, fmt::format("{:<28} {} counted targets (reference {})",
                                                           label + "/num_tokens", free.num_targets, ref_count));
  }
  if (!bf16 && routing.flips > 0 && routing.ok()) {
    judge_fp32_after_near_ties(report, label, prefix, model, batch, ref, free, reference, source, routing);
    return;
  }
  const auto report_routing = [&] {
    if (!reference.empty()) {
      report.line(routing.ok(), fmt::format("{:<28} {}{}", label + "/routing", routing.summary(), source));
    }
  };
  if (!bf16) {
    report_routing();
    std::vector<Fp32Group> groups{{label + "/logits", {{logits_key, free.logits_error}}, th.logits},
                                  {label + "/loss", {{loss_key, free.loss_error}}, th.loss}};
    if (!reference.empty()) {
      Fp32Group router{label + "/router_logits", {}, th.router_logits};
      for (size_t i = 0; i < reference.size(); ++i) {
        router.errors.emplace_back(fmt::format("{}router_logits.{}", prefix, i),
                                   relative_error(free.router_logits[i], reference[i]));
      }
      groups.push_back(std::move(router));
    }
    groups.push_back({label + "/grads", free.grad_errors, th.grads});
    judge_fp32_groups(report, label, prefix, model, batch, ref, reference, groups);
    return;
  }

  Bf16Groups ours = judge_pass(free, reference, prefix, ref);
  // Near-tie flips: the same case again with every router selecting from the reference's router logits.
  std::unique_ptr<Bf16Groups> pinned;
  if (!reference.empty() && (routing.flips > 0 || pin_always)) {
    const std::vector<Tensor> pinned_logits = router_logits_for_pinning(reference, model.device());
    model::MicroBatch pinned_batch = batch;
    pinned_batch.pinned_routing = &pinned_logits;
    const PassResult pass = run_pass(report, label + "/pinned", prefix, model, pinned_batch, ref);
    pinned = std::make_unique<Bf16Groups>(judge_pass(pass, reference, prefix, ref));
  }
  // Over a bound, or a flip the layer's sigma does not explain: the bf16 rounding ensemble (check_golden_judge.h).
  std::string rule = kBf16Rule;
  const bool over = !within(ours) || (pinned && !within(*pinned));
  if (f32_model != nullptr && (over || !routing.ok() || report.every_tensor())) {
    const CaseSpreads spreads =
        measure_case_spreads(*f32_model, batch, ref, prefix, reference, golden::kUnitRoundoffBf16);
    widen(ours, spreads);
    if (pinned) widen(*pinned, spreads);
    rule += fmt::format(" + {} x spread", golden::kEnsembleSpreads);
    report.info(
        fmt::format("{:<28} bounds widened by {} spreads of a rounding ensemble of {} f32 runs, each weight "
                    "moved by one bf16 rounding (u = 2^-9){}",
                    label, golden::kEnsembleSpreads, golden::kEnsembleMembers,
                    reference.empty() ? "" : ", routing pinned to the reference's"));
    if (!routing.ok()) {
      // Flips the layer's sigma does not explain: how far one bf16 rounding of the weights moves each token.
      routing = RoutingCheck{};
      routing.explain_near_ties = true;
      routing.after_rounding = &spreads.member_router_logits;
      routing.moved_from_reference = true;
      routing.rounding = "bf16";
      routing.add_pass(reference, free.router_logits, model.config().num_experts_per_tok, batch.cu_seqlens_host);
    }
  }
  report_routing();
  if (pinned) {
    const std::string how = " (every router selecting from the reference's router logits" + source + ")";
    report.judged(label + "/pinned/logits", pinned->logits, "theirs", rule + how);
    report.judged(label + "/pinned/loss", pinned->loss, "theirs", rule + ", theirs = CE of bf16ref." + logits_key);
    report.judged(label + "/pinned/router_logits", pinned->router_logits, "theirs",
                  rule + ", theirs = that of " + logits_key + source);
    report.judged(label + "/pinned/grads", pinned->grads, "theirs", rule);
  }
  const bool explained = routing.ok();
  report_free_group(report, label + "/logits", ours.logits, pinned ? &pinned->logits : nullptr, explained, "theirs",
                    rule);
  report_free_group(report, label + "/loss", ours.loss, pinned ? &pinned->loss : nullptr, explained, "theirs",
                    rule + ", theirs = CE of bf16ref." + logits_key);
  if (!reference.empty()) {
    report_free_group(report, label + "/router_logits", ours.router_logits, pinned ? &pinned->router_logits : nullptr,
                      explained, "theirs", rule + ", theirs = that of " + logits_key + source);
  }
  report_free_group(report, label + "/grads", ours.grads, pinned ? &pinned->grads : nullptr, explained, "theirs", rule);
}

void run_batch_case(Report& report, model::CausalLm& model, model::CausalLm* f32_model,
                    const io::SafetensorsReader& ref, bool bf16, bool pin_always) {
  const model::MicroBatch batch = model::MicroBatch::from_rows(ref.tensor("input_ids"), ref.tensor("targets"));
  run_forward_backward_case(report, "batch", "", model, f32_model, batch, ref, bf16, pin_always);
}

void run_packed_case(Report& report, model::CausalLm& model, model::CausalLm* f32_model,
                     const io::SafetensorsReader& ref, bool bf16, bool pin_always) {
  const model::MicroBatch batch =
      model::MicroBatch::packed(ref.tensor("packed.input_ids").clone(), ref.tensor("packed.targets").clone(),
                                ref.tensor("packed.cu_seqlens").clone());
  const auto ours = batch.position_ids.to_vector<int32_t>();
  const auto theirs = ref.tensor("packed.position_ids").to_vector<int32_t>();
  report.line(ours == theirs, fmt::format("{:<28} {} documents, positions restart per document: {}", "packed/positions",
                                          batch.num_documents(), ours == theirs ? "same as reference" : "DIFFERENT"));
  run_forward_backward_case(report, "packed", "packed.", model, f32_model, batch, ref, bf16, pin_always);
}

// The compute dtype and the residual stream's (CausalLm::stream_dtype): bf16 compute is judged with an f32 stream
// by default, the recipe of the reference's autocast (--residual).
struct Precision {
  DType compute = DType::F32;
  DType stream = DType::F32;
};
constexpr Precision kF32{DType::F32, DType::F32};

std::unique_ptr<model::CausalLm> load_model(const std::string& model_dir, Device device, Precision precision) {
  auto model = model::CausalLm::from_hf(model_dir, device, precision.compute);
  model->set_stream_dtype(precision.stream);
  return model;
}

// Router logits of one micro-batch (per MoE layer, [T, E]) that select as the model's own do except at `choices`,
// where the passed-over expert is selected instead of the kept one, for MicroBatch::pinned_routing: the two logits
// are exchanged when the run ranks them as the choice does (the routing weights still come from the run's own).
std::vector<Tensor> router_logits_reversing(model::CausalLm& model, const model::MicroBatch& batch,
                                            const std::vector<golden::RoutingChoice>& choices, Device device) {
  std::vector<Tensor> logits;
  for (const Tensor& layer : observed_router_logits(model, batch)) {
    logits.push_back(layer.to(Device::cpu()).to(DType::F32).clone());
  }
  for (const golden::RoutingChoice& choice : choices) {
    Tensor& layer = logits.at(choice.layer);
    MT_CHECK(choice.token < layer.size(0), "check-golden: routing choice at token {} of {}", choice.token,
             layer.size(0));
    float* row = layer.data<float>() + choice.token * layer.size(1);
    const size_t in = size_t(choice.passed_over), out = size_t(choice.kept);
    if (row[in] < row[out]) std::swap(row[in], row[out]);
    if (row[in] == row[out]) row[in] = std::nextafter(row[in], std::numeric_limits<float>::infinity());
  }
  return router_logits_for_pinning(logits, device);
}

// A member of a rounding ensemble: its seed and the relative size u of the rounding it adds before every step.
struct EnsembleMember {
  uint64_t seed = 0;
  double unit = golden::kUnitRoundoffF32;
};

// One model stepping through the trajectory: AdamW as the reference's, the global-norm clip at 1.0. A member of
// the rounding ensemble perturbs its weights by one rounding before every step.
struct Stepper {
  std::unique_ptr<model::CausalLm> model;
  std::unique_ptr<train::AdamW> optimizer;
  Device device;
  std::optional<EnsembleMember> member;
  std::vector<golden::RoutingChoice> reversed;  // choices this run resolves the other way
  int64_t steps_taken = 0;
  int64_t steps_perturbed = 0;

  Stepper(const std::string& model_dir, Device d, Precision precision, std::optional<EnsembleMember> m = std::nullopt,
          std::vector<golden::RoutingChoice> r = {})
      : model(load_model(model_dir, d, precision)),
        optimizer(std::make_unique<train::AdamW>(model->params(), train::AdamWConfig{1e-3, 0.9, 0.95, 1e-8, 0.1})),
        device(d),
        member(m),
        reversed(std::move(r)) {}
  // A member's rounding of every weight before the next step, once: before the step's weights are observed too.
  void begin_step() {
    if (!member || steps_perturbed > steps_taken) return;
    perturb_by_one_rounding(model->params(), member->unit, member->seed, steps_taken);
    ++steps_perturbed;
  }
  // Returns the step's loss and the gradient norm before clipping.
  std::pair<double, double> step(const std::vector<model::MicroBatch>& batches) {
    begin_step();
    std::vector<model::MicroBatch> run_batches = batches;
    std::vector<std::vector<Tensor>> reversing(batches.size());
    for (size_t mb = 0; mb < batches.size(); ++mb) {
      std::vector<golden::RoutingChoice> here;
      for (const golden::RoutingChoice& c : reversed) {
        if (c.step == steps_taken && c.micro_batch == mb) here.push_back(c);
      }
      if (here.empty()) continue;
      reversing[mb] = router_logits_reversing(*model, batches[mb], here, device);
      run_batches[mb].pinned_routing = &reversing[mb];
    }
    ++steps_taken;
    model->params().zero_grads();
    const double loss = pipeline::forward_backward(*model, run_batches).loss;
    const double norm = ops::clip_by_global_norm(default_stream(device), model->params().all_grads(), 1.0);
    optimizer->step(1e-3);  // writes the bf16 compute copies too
    return {loss, norm};
  }
};

// The micro-batches of every trajectory step, as the reference lists them.
std::vector<std::vector<model::MicroBatch>> trajectory_batches(const io::SafetensorsReader& ref, int64_t steps) {
  std::vector<std::vector<model::MicroBatch>> all;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<model::MicroBatch> batches;
    for (int mb = 0;; ++mb) {
      const std::string key = fmt::format("traj.step{}.mb{}.", step, mb);
      if (!ref.contains(key + "input_ids")) break;
      batches.push_back(model::MicroBatch::from_rows(ref.tensor(key + "input_ids"), ref.tensor(key + "targets")));
    }
    MT_CHECK(!batches.empty(), "check-golden: trajectory step {} has no micro-batches in the reference", step);
    all.push_back(std::move(batches));
  }
  return all;
}

// One run's trajectory quantities into an ensemble: the step losses, the step gradient norms, each final tensor.
void add_trajectory_run(golden::EnsembleStats& ensemble, const io::SafetensorsReader& ref, const Stepper& run,
                        const std::vector<double>& losses, const std::vector<double>& norms) {
  const int64_t count = static_cast<int64_t>(losses.size());
  ensemble.add("traj.loss", Tensor::from_vector(losses, {count}));
  ensemble.add("traj.grad_norm", Tensor::from_vector(norms, {count}));
  for (const auto& [name, tensor] : run.model->params().export_hf_runtime(
           false, [&](const std::string& fused) { return ref.contains("traj.final." + fused); })) {
    ensemble.add(name, tensor);
  }
}

// `members` fp32 runs through the trajectory, each adding a rounding of relative size `unit` to every weight before
// every step (check_golden_judge.h), and each resolving the `reversed` choices the other way.
void run_rounding_ensemble(golden::EnsembleStats& ensemble, const std::string& model_dir, Device device,
                           const io::SafetensorsReader& ref, const std::vector<std::vector<model::MicroBatch>>& steps,
                           double unit, int members, const std::vector<golden::RoutingChoice>& reversed = {}) {
  for (int seed = 1; seed <= members; ++seed) {
    Stepper run(model_dir, device, kF32, EnsembleMember{static_cast<uint64_t>(seed), unit}, reversed);
    std::vector<double> losses, norms;
    for (const auto& batches : steps) {
      const auto [loss, norm] = run.step(batches);
      losses.push_back(loss);
      norms.push_back(norm);
    }
    add_trajectory_run(ensemble, ref, run, losses, norms);
  }
}

// Every top-k choice of one micro-batch of our run with its margin and the median over the members of how far their
// logits lie from ours at the token (the largest difference over its experts).
void add_routing_choices(std::vector<golden::RoutingChoice>& choices, const std::vector<Tensor>& ours,
                         const std::vector<std::vector<Tensor>>& members, int64_t k, int64_t step, size_t micro_batch) {
  for (size_t layer = 0; layer < ours.size(); ++layer) {
    const Tensor our_logits = ours[layer].to(Device::cpu()).to(DType::F32);
    std::vector<Tensor> member_logits;
    for (const auto& member : members) member_logits.push_back(member.at(layer).to(Device::cpu()).to(DType::F32));
    const int64_t experts = our_logits.size(1);
    for (int64_t t = 0; t < our_logits.size(0); ++t) {
      const float* o = our_logits.data<float>() + t * experts;
      std::vector<int> order(static_cast<size_t>(experts));
      for (int e = 0; e < experts; ++e) order[size_t(e)] = e;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return o[a] > o[b]; });
      golden::RoutingChoice choice{step, micro_batch, layer, t, order[size_t(k - 1)], order[size_t(k)]};
      choice.margin = double(o[choice.kept]) - double(o[choice.passed_over]);
      std::vector<double> moves;
      for (const Tensor& member : member_logits) {
        moves.push_back(golden::largest_difference(member.data<float>() + t * experts, o, experts));
      }
      std::nth_element(moves.begin(), moves.begin() + moves.size() / 2, moves.end());
      choice.move = moves.empty() ? 0.0 : moves[moves.size() / 2];
      choices.push_back(choice);
    }
  }
}

// The `per_step` top-k choices of each step of our fp32 trajectory closest to a tie: ours and a rounding ensemble
// step in lockstep, and before every step each run's router logits are observed.
std::vector<golden::RoutingChoice> closest_routing_choices(const std::string& model_dir, Device device,
                                                           const std::vector<std::vector<model::MicroBatch>>& steps,
                                                           const std::vector<golden::RoutingChoice>& reversed,
                                                           size_t per_step) {
  Stepper ours(model_dir, device, kF32, std::nullopt, reversed);
  std::vector<std::unique_ptr<Stepper>> members;
  for (int seed = 1; seed <= golden::kTrajectoryEnsembleMembers; ++seed) {
    members.push_back(std::make_unique<Stepper>(model_dir, device, kF32,
                                                EnsembleMember{uint64_t(seed), golden::kUnitRoundoffF32}, reversed));
  }
  std::vector<golden::RoutingChoice> choices;
  for (size_t s = 0; s < steps.size(); ++s) {
    for (auto& member : members) member->begin_step();
    for (size_t mb = 0; mb < steps[s].size(); ++mb) {
      std::vector<std::vector<Tensor>> member_logits;
      for (auto& member : members) member_logits.push_back(observed_router_logits(*member->model, steps[s][mb]));
      add_routing_choices(choices, observed_router_logits(*ours.model, steps[s][mb]), member_logits,
                          ours.model->config().num_experts_per_tok, int64_t(s), mb);
    }
    ours.step(steps[s]);
    for (auto& member : members) member->step(steps[s]);
  }
  // The closest of each step: later steps' members have drifted further (their own flips move whole sequences), and
  // ranking the whole trajectory together would leave only those.
  std::vector<golden::RoutingChoice> closest;
  for (size_t s = 0; s < steps.size(); ++s) {
    std::vector<golden::RoutingChoice> of_step;
    for (const golden::RoutingChoice& c : choices) {
      if (c.step == int64_t(s) && golden::flip_is_near_tie(c.margin, c.move)) of_step.push_back(c);
    }
    const size_t kept = std::min(per_step, of_step.size());
    std::partial_sort(
        of_step.begin(), of_step.begin() + kept, of_step.end(),
        [](const golden::RoutingChoice& a, const golden::RoutingChoice& b) { return a.closeness() < b.closeness(); });
    closest.insert(closest.end(), of_step.begin(), of_step.begin() + kept);
  }
  return closest;
}

// One trajectory run's quantities against the reference's: the step losses, the step gradient norms, each final tensor.
struct TrajectoryErrors {
  double loss = 0.0, grad_norm = 0.0;
  std::vector<std::pair<std::string, double>> weights;
};

TrajectoryErrors trajectory_errors(Report& report, const io::SafetensorsReader& ref, const Stepper& run,
                                   const std::vector<double>& losses, const std::vector<double>& norms) {
  const int64_t count = static_cast<int64_t>(losses.size());
  TrajectoryErrors e;
  e.loss = relative_error(Tensor::from_vector(losses, {count}), ref.tensor("traj.loss").to(DType::F64));
  e.grad_norm = relative_error(Tensor::from_vector(norms, {count}), ref.tensor("traj.grad_norm").to(DType::F64));
  e.weights = compare_named(run.model->params(), false, ref, "traj.final.", report, "trajectory");
  return e;
}

// A rounding ensemble's judgement of the trajectory: each quantity's mean within the fp32 threshold + kEnsembleSpreads
// spreads of the reference's.
struct EnsembleJudgement {
  std::vector<Judged> loss, grad_norm, final_weights;
  bool within() const {
    for (const auto* group : {&loss, &grad_norm, &final_weights}) {
      if (!std::all_of(group->begin(), group->end(), [](const Judged& j) { return j.within(); })) return false;
    }
    return true;
  }
  // How far a single run's errors reach into these bounds: the largest error over its bound (at most 1: within all).
  double reach(const TrajectoryErrors& run) const {
    double largest = std::max(run.loss / loss.at(0).bound, run.grad_norm / grad_norm.at(0).bound);
    for (size_t i = 0; i < run.weights.size() && i < final_weights.size(); ++i) {
      largest = std::max(largest, run.weights[i].second / final_weights[i].bound);
    }
    return largest;
  }
  void report_to(Report& report, const std::string& prefix) const {
    const std::string rule = fmt::format("fp32 threshold + {} x spread", golden::kEnsembleSpreads);
    report.judged(prefix + "loss", loss, "spread", rule, "mean");
    report.judged(prefix + "grad_norm", grad_norm, "spread", rule, "mean");
    report.judged(prefix + "final_weights", final_weights, "spread", rule, "mean");
  }
};

EnsembleJudgement judge_by_ensemble(const golden::EnsembleStats& ensemble, const io::SafetensorsReader& ref,
                                    const TrajectoryErrors& ours) {
  const Thresholds th;
  const auto judge = [&](const std::string& name, const Tensor& reference, double threshold) {
    const auto [center, spread] = ensemble.center_and_spread(name, reference);
    return Judged{name, center, spread, threshold + golden::kEnsembleSpreads * spread};
  };
  EnsembleJudgement j;
  j.loss.push_back(judge("traj.loss", ref.tensor("traj.loss").to(DType::F64), th.trajectory_loss));
  j.grad_norm.push_back(judge("traj.grad_norm", ref.tensor("traj.grad_norm").to(DType::F64), th.trajectory_grad_norm));
  for (const auto& [name, error] : ours.weights) {
    j.final_weights.push_back(judge(name, ref.tensor("traj.final." + name), th.trajectory_weights));
  }
  return j;
}

// One fp32 run through the trajectory, resolving `reversed` the other way; its losses and gradient norms.
struct TrajectoryRun {
  std::unique_ptr<Stepper> stepper;
  std::vector<double> losses, norms;
};

TrajectoryRun run_trajectory(const std::string& model_dir, Device device,
                             const std::vector<std::vector<model::MicroBatch>>& steps,
                             const std::vector<golden::RoutingChoice>& reversed) {
  TrajectoryRun run{std::make_unique<Stepper>(model_dir, device, kF32, std::nullopt, reversed), {}, {}};
  for (const auto& batches : steps) {
    const auto [loss, norm] = run.stepper->step(batches);
    run.losses.push_back(loss);
    run.norms.push_back(norm);
  }
  return run;
}

// The search for top-k near ties the reference resolved the other way (check_golden_judge.h, RoutingChoice). Greedy,
// up to kMaxReversedChoices rounds: of our near ties closest to a tie, kReversedChoicesPerStep a step (ours and the
// ensemble carrying the reversals so far), the one whose reversal brings a single run of ours nearest the reference
// by the current ensemble's bounds is added when it takes the run to within 1 / kReversalGain of where it was, and a
// new ensemble with every reversal in every run judges. Reports and returns true when one is within; otherwise reports
// the search and returns false.
bool search_reversals(Report& report, const std::string& model_dir, Device device, const io::SafetensorsReader& ref,
                      const std::vector<std::vector<model::MicroBatch>>& steps, EnsembleJudgement judgement,
                      double reach) {
  Report unused;
  std::vector<golden::RoutingChoice> reversed;
  for (size_t round = 0; round < golden::kMaxReversedChoices; ++round) {
    std::optional<golden::RoutingChoice> best;
    TrajectoryRun best_run;
    TrajectoryErrors best_errors;
    double best_reach = reach / golden::kReversalGain;  // a reversal must remove most of the excess
    for (const golden::RoutingChoice& choice :
         closest_routing_choices(model_dir, device, steps, reversed, golden::kReversedChoicesPerStep)) {
      std::vector<golden::RoutingChoice> candidate = reversed;
      candidate.push_back(choice);
      TrajectoryRun run = run_trajectory(model_dir, device, steps, candidate);
      TrajectoryErrors run_errors = trajectory_errors(unused, ref, *run.stepper, run.losses, run.norms);
      const double run_reach = judgement.reach(run_errors);
      if (run_reach < best_reach) {
        best_reach = run_reach;
        best = choice;
        best_run = std::move(run);
        best_errors = std::move(run_errors);
      }
    }
    if (!best) break;
    reversed.push_back(*best);
    golden::EnsembleStats ensemble;
    add_trajectory_run(ensemble, ref, *best_run.stepper, best_run.losses, best_run.norms);
    run_rounding_ensemble(ensemble, model_dir, device, ref, steps, golden::kUnitRoundoffF32,
                          golden::kTrajectoryEnsembleMembers, reversed);
    judgement = judge_by_ensemble(ensemble, ref, best_errors);
    const double reach_before = reach;
    reach = judgement.reach(best_errors);
    report.info(
        fmt::format("{:<28} reversing {} (round {}): a single run of ours from {:.2f} to {:.2f} of the "
                    "bounds",
                    "trajectory", best->describe(), round + 1, reach_before, best_reach));
    if (judgement.within()) {
      report.info(fmt::format("{:<28} judged by a rounding ensemble with {} choice(s) reversed in every run",
                              "trajectory", reversed.size()));
      judgement.report_to(report, "trajectory/reversed_ties/");
      return true;
    }
  }
  report.info(fmt::format("{:<28} no reversal of up to {} of our top-k near ties brings the ensemble within",
                          "trajectory", golden::kMaxReversedChoices));
  return false;
}

// The fp32 trajectory: the fp32 thresholds on our run; where it misses one, every quantity is judged by the rounding
// ensemble instead (check_golden_judge.h): the ensemble's mean within kEnsembleSpreads spreads (plus the threshold)
// of the reference's. In an MoE model where that fails, the reference may have resolved a top-k near tie the other
// way, and search_reversals looks for it.
void judge_fp32_trajectory(Report& report, const std::string& model_dir, Device device,
                           const io::SafetensorsReader& ref, const std::vector<std::vector<model::MicroBatch>>& steps,
                           Stepper& ours, const std::vector<double>& losses, const std::vector<double>& norms) {
  const Thresholds th;
  const TrajectoryErrors errors = trajectory_errors(report, ref, ours, losses, norms);
  const bool weights_within = std::all_of(errors.weights.begin(), errors.weights.end(),
                                          [&](const auto& e) { return e.second <= th.trajectory_weights; });
  if (errors.loss <= th.trajectory_loss && errors.grad_norm <= th.trajectory_grad_norm && weights_within) {
    report.group("trajectory/loss", {{"traj.loss", errors.loss}}, th.trajectory_loss);
    report.group("trajectory/grad_norm", {{"traj.grad_norm", errors.grad_norm}}, th.trajectory_grad_norm);
    report.group("trajectory/final_weights", errors.weights, th.trajectory_weights);
    return;
  }
  std::string worst_weight = "none compared";
  if (!errors.weights.empty()) {
    const auto worst = *std::max_element(errors.weights.begin(), errors.weights.end(),
                                         [](const auto& a, const auto& b) { return a.second < b.second; });
    worst_weight = fmt::format("{:.3e} in {}", worst.second, worst.first);
  }
  report.info(
      fmt::format("{:<28} ours over an fp32 threshold (loss {:.3e}, grad norm {:.3e}, final weights {}): "
                  "judged by a rounding ensemble of {} more runs",
                  "trajectory", errors.loss, errors.grad_norm, worst_weight, golden::kTrajectoryEnsembleMembers));
  golden::EnsembleStats ensemble;
  add_trajectory_run(ensemble, ref, ours, losses, norms);
  run_rounding_ensemble(ensemble, model_dir, device, ref, steps, golden::kUnitRoundoffF32,
                        golden::kTrajectoryEnsembleMembers);
  const EnsembleJudgement judgement = judge_by_ensemble(ensemble, ref, errors);
  if (judgement.within() || !ours.model->config().is_moe()) {
    judgement.report_to(report, "trajectory/ensemble/");
    return;
  }
  if (!search_reversals(report, model_dir, device, ref, steps, judgement, judgement.reach(errors))) {
    judgement.report_to(report, "trajectory/ensemble/");
  }
}

// The trajectory of one bf16 run, judged: losses and gradient norms against the reference's, router logits against
// the f32 shadow's, and the final weights against the reference's own update of each tensor.
struct TrajectoryGroups {
  std::vector<Judged> loss, grad_norm, router_logits, final_weights;
};

// Whether a bf16 trajectory's groups pass as report_free_group would judge them: every pinned group within its
// bounds, and every free tensor within its bound or excused by the pinned run.
bool trajectory_within(const TrajectoryGroups& free, const TrajectoryGroups* held, bool flips_explained) {
  const auto all_within = [](const std::vector<Judged>& g) {
    return std::all_of(g.begin(), g.end(), [](const Judged& j) { return j.within(); });
  };
  const auto free_within = [&](const std::vector<Judged>& g, const std::vector<Judged>* pinned) {
    return pinned == nullptr ? all_within(g)
                             : all_within(golden::excuse_by_pinned_pass(g, *pinned, flips_explained).kept);
  };
  if (held != nullptr && !(all_within(held->loss) && all_within(held->grad_norm) && all_within(held->router_logits) &&
                           all_within(held->final_weights))) {
    return false;
  }
  return free_within(free.router_logits, held ? &held->router_logits : nullptr) &&
         free_within(free.loss, held ? &held->loss : nullptr) &&
         free_within(free.grad_norm, held ? &held->grad_norm : nullptr) &&
         free_within(free.final_weights, held ? &held->final_weights : nullptr);
}

// In bf16 an f32 shadow of an MoE model steps alongside: the dump has no router logits for the trajectory, and the
// shadow's routing stands in for the reference's at every step (the f32 check holds the shadow's trajectory to the
// reference's). A third model, pinned, steps in bf16 with every router selecting from the shadow's router logits of
// the step (MicroBatch::pinned_routing): where our free run's near-tie flips carry it over a bound, the pinned run
// shows whether removing them removes the excess (check_golden_judge.h).
void run_trajectory_case(Report& report, const std::string& model_dir, Device device, Precision precision,
                         const io::SafetensorsReader& ref, bool bf16, bool pin_always) {
  const Thresholds th;
  Stepper ours(model_dir, device, precision);
  std::unique_ptr<Stepper> shadow, pinned;
  if (bf16 && ours.model->config().is_moe()) {
    shadow = std::make_unique<Stepper>(model_dir, device, kF32);
    pinned = std::make_unique<Stepper>(model_dir, device, precision);
  }
  std::map<std::string, Tensor> start;
  if (bf16) {
    for (auto& [name, tensor] : ours.model->params().export_hf_runtime(
             false, [&](const std::string& fused) { return ref.contains("traj.final." + fused); })) {
      start.emplace(name, std::move(tensor));
    }
  }
  RoutingCheck routing, routing_at_start;  // every step; step 0 alone (the weights still the shadow's)
  routing.explain_near_ties = routing_at_start.explain_near_ties = true;
  TrajectoryGroups free, held;  // held: the pinned run
  const double theirs_logits = shadow ? golden::theirs_error(ref, "logits") : 0.0;
  const Tensor ref_losses = ref.tensor("traj.loss").to(DType::F64);
  const Tensor ref_norms = ref.tensor("traj.grad_norm").to(DType::F64);
  const int64_t steps = ref_losses.numel();
  std::vector<double> losses, norms, pinned_losses, pinned_norms;
  const std::vector<std::vector<model::MicroBatch>> all_batches = trajectory_batches(ref, steps);
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<model::MicroBatch>& batches = all_batches[static_cast<size_t>(step)];
    if (shadow) {
      // Router logits of this step's weights, from forward passes apart from the step itself (observing the
      // training pass would make it materialise the logits instead of its fused head).
      model::ForwardObservation ours_seen, f32_seen, pinned_seen;
      pipeline::forward_only(*ours.model, batches, &ours_seen);
      pipeline::forward_only(*shadow->model, batches, &f32_seen);
      std::vector<model::MicroBatch> pinned_batches = batches;
      for (size_t mb = 0; mb < batches.size(); ++mb) pinned_batches[mb].pinned_routing = &f32_seen.router_logits[mb];
      pipeline::forward_only(*pinned->model, pinned_batches, &pinned_seen);
      for (size_t mb = 0; mb < batches.size(); ++mb) {
        for (size_t i = 0; i < ours_seen.router_logits[mb].size(); ++i) {
          const std::string name = fmt::format("step{}.mb{}.router_logits.{}", step, mb, i);
          const Tensor& f32_logits = f32_seen.router_logits[mb].at(i);
          free.router_logits.push_back(
              judge_bf16(name, relative_error(ours_seen.router_logits[mb][i], f32_logits), theirs_logits));
          held.router_logits.push_back(
              judge_bf16(name, relative_error(pinned_seen.router_logits[mb].at(i), f32_logits), theirs_logits));
        }
        // At step 0, where the weights are still the f32 path's: how far one bf16 rounding of them moves each token.
        std::vector<std::vector<Tensor>> moved;
        if (step == 0)
          moved = router_logits_after_roundings(*shadow->model, pinned_batches[mb], golden::kUnitRoundoffBf16);
        for (RoutingCheck* check : {&routing, step == 0 ? &routing_at_start : nullptr}) {
          if (check == nullptr) continue;
          check->after_rounding = step == 0 ? &moved : nullptr;
          check->moved_from_reference = true;
          check->rounding = "bf16";
          check->add_pass(f32_seen.router_logits[mb], ours_seen.router_logits[mb],
                          ours.model->config().num_experts_per_tok, batches[mb].cu_seqlens_host,
                          fmt::format("step {} mb {} ", step, mb));
        }
      }
      const auto [pinned_loss, pinned_norm] = pinned->step(pinned_batches);
      pinned_losses.push_back(pinned_loss);
      pinned_norms.push_back(pinned_norm);
      shadow->step(batches);
    }
    const auto [loss, norm] = ours.step(batches);
    losses.push_back(loss);
    norms.push_back(norm);
  }
  const auto final_weight_errors = [&](Stepper& stepper) {
    return compare_named(stepper.model->params(), false, ref, "traj.final.", report, "trajectory");
  };
  if (!bf16) {
    judge_fp32_trajectory(report, model_dir, device, ref, all_batches, ours, losses, norms);
    return;
  }
  // No bf16ref for the trajectory: the batch case's yardstick (check_golden_judge.h says why).
  std::vector<std::string> grad_keys;
  for (const std::string& name : ref.names()) {
    if (name.rfind("grad.", 0) == 0) grad_keys.push_back(name);
  }
  const double theirs_loss = golden::theirs_loss_error(ref, ""),
               theirs_norm = golden::theirs_error_over(ref, grad_keys);
  const auto judge_run = [&](Stepper& stepper, const std::vector<double>& run_losses,
                             const std::vector<double>& run_norms, TrajectoryGroups& g) {
    g.loss.push_back(
        judge_bf16("traj.loss", relative_error(Tensor::from_vector(run_losses, {steps}), ref_losses), theirs_loss));
    g.grad_norm.push_back(
        judge_bf16("traj.grad_norm", relative_error(Tensor::from_vector(run_norms, {steps}), ref_norms), theirs_norm));
    for (const auto& [name, error] : final_weight_errors(stepper)) {
      const auto it = start.find(name);
      MT_CHECK(it != start.end(), "check-golden: no start weights for '{}'", name);
      const double update =
          relative_error(it->second, ref.tensor("traj.final." + name));  // ||W_0 - W_ref|| / ||W_ref||
      g.final_weights.push_back({name, error, update, golden::kTrajectoryUpdateShare * update + th.trajectory_weights});
    }
  };
  judge_run(ours, losses, norms, free);
  const std::string loss_rule = kBf16Rule + ", theirs = that of the batch loss";
  const std::string norm_rule = kBf16Rule + ", theirs = that of all batch gradients together";
  const std::string router_rule = kBf16Rule +
                                  ", theirs = that of the batch logits (against our f32 path stepping "
                                  "alongside: the dump has no router logits here)";
  std::string weights_rule = fmt::format("{} x update + {:.0e}, update = ||W_ref - W_0|| / ||W_ref||",
                                         golden::kTrajectoryUpdateShare, th.trajectory_weights);
  // The pinned run is judged whenever it ran; the free run's tensors over their bound are excused by it only after
  // flips that rounding explains.
  bool explained = routing.ok();
  const bool pin = pinned != nullptr && (routing.flips > 0 || pin_always);
  if (pin) judge_run(*pinned, pinned_losses, pinned_norms, held);
  const TrajectoryGroups* held_groups = pin ? &held : nullptr;
  const bool within = trajectory_within(free, held_groups, explained) && (!shadow || routing.ok());
  std::string widened;
  if (!within) {
    // Over a bound: the trajectory may carry bf16's rounding further than the batch case's yardstick allows. The
    // losses, norms and final weights get the spread of a bf16-sized rounding ensemble on top of their bounds; the
    // router logits and top-k choices are judged where our weights are still the shadow's, at step 0
    // (check_golden_judge.h).
    golden::EnsembleStats ensemble;
    run_rounding_ensemble(ensemble, model_dir, device, ref, all_batches, golden::kUnitRoundoffBf16,
                          golden::kEnsembleMembers);
    const auto widen = [&](TrajectoryGroups& g) {
      for (Judged& j : g.loss) {
        j.bound += golden::kEnsembleSpreads * ensemble.center_and_spread(j.name, ref_losses).second;
      }
      for (Judged& j : g.grad_norm) {
        j.bound += golden::kEnsembleSpreads * ensemble.center_and_spread(j.name, ref_norms).second;
      }
      for (Judged& j : g.final_weights) {
        j.bound +=
            golden::kEnsembleSpreads * ensemble.center_and_spread(j.name, ref.tensor("traj.final." + j.name)).second;
      }
      std::erase_if(g.router_logits, [](const Judged& j) { return j.name.rfind("step0.", 0) != 0; });
    };
    widen(free);
    if (pin) widen(held);
    report.info(
        fmt::format("{:<28} over a bf16 bound: losses, gradient norms and final weights get {} spreads of a "
                    "rounding ensemble of {} fp32 runs, each weight moved by one bf16 rounding (u = 2^-9) "
                    "before every step; router logits and top-k choices judged at step 0, where our weights "
                    "are the f32 path's",
                    "trajectory", golden::kEnsembleSpreads, golden::kEnsembleMembers));
    if (shadow) {
      report.info(fmt::format("{:<28} all steps: {}", "trajectory/routing", routing.summary()));
      explained = routing_at_start.ok();
    }
    widened = fmt::format(" + {} x ensemble spread", golden::kEnsembleSpreads);
    weights_rule += widened;
  }
  const std::string loss_rule_used = loss_rule + widened, norm_rule_used = norm_rule + widened;
  if (pin) {
    report.judged("trajectory/pinned/loss", held.loss, "theirs", loss_rule_used);
    report.judged("trajectory/pinned/grad_norm", held.grad_norm, "theirs", norm_rule_used);
    report.judged("trajectory/pinned/router_logits", held.router_logits, "theirs", router_rule);
    report.judged("trajectory/pinned/final_weights", held.final_weights, "update", weights_rule);
  }
  if (shadow) {
    const RoutingCheck& judged_routing = within ? routing : routing_at_start;
    report_free_group(report, "trajectory/router_logits", free.router_logits,
                      held_groups ? &held.router_logits : nullptr, explained, "theirs", router_rule);
    report.line(judged_routing.ok(),
                fmt::format("{:<28} {}{}", "trajectory/routing", judged_routing.summary(),
                            within ? " (against our f32 path stepping alongside)" : " (step 0, against our f32 path)"));
  }
  report_free_group(report, "trajectory/loss", free.loss, held_groups ? &held.loss : nullptr, explained, "theirs",
                    loss_rule_used);
  report_free_group(report, "trajectory/grad_norm", free.grad_norm, held_groups ? &held.grad_norm : nullptr, explained,
                    "theirs", norm_rule_used);
  report_free_group(report, "trajectory/final_weights", free.final_weights, held_groups ? &held.final_weights : nullptr,
                    explained, "update", weights_rule);
}

}  // namespace

int run_check_golden(const CheckGoldenOptions& options) {
  const std::set<std::string> known{"batch", "packed", "trajectory", "all"};
  MT_CHECK(known.count(options.cases), "check-golden: --case expects batch, packed, trajectory or all but found '{}'",
           options.cases);
  MT_CHECK(options.dtype == "f32" || options.dtype == "bf16",
           "check-golden: --dtype expects f32 or bf16 but found '{}'", options.dtype);
  MT_CHECK(options.residual == "f32" || options.residual == "compute",
           "check-golden: --residual expects f32 or compute but found '{}'", options.residual);
  const Device device = parse_device(options.device);
  const DType dtype = options.dtype == "bf16" ? DType::BF16 : DType::F32;
  const Precision precision{dtype, options.residual == "f32" ? DType::F32 : dtype};
  MT_CHECK(dtype == DType::F32 || device.is_cuda(), "check-golden: --dtype bf16 needs --device cuda (found {})",
           device.str());
  if (device.is_cuda()) ops::cuda::setup_cuda(device.index);
  const bool bf16 = dtype == DType::BF16 || options.judge_as_bf16;
  const io::SafetensorsReader ref = io::SafetensorsReader::open(options.reference);
  auto model = load_model(options.model_dir, device, precision);
  std::printf("check-golden: %s (%s, %lld parameters) against %s on %s, %s compute, %s residual stream%s\n",
              options.model_dir.c_str(), model->config().model_type.c_str(),
              static_cast<long long>(model->params().num_parameters()), options.reference.c_str(), device.str().c_str(),
              options.dtype.c_str(), std::string(dtype_name(precision.stream)).c_str(),
              bf16 ? ", judged against transformers' own bf16 error (bf16ref.*)" : "");
  const bool all = options.cases == "all";
  std::unique_ptr<model::CausalLm> f32_model;  // the f32 path beside a bf16 one (run_forward_backward_case)
  if (bf16 && (all || options.cases == "batch" || options.cases == "packed")) {
    f32_model = load_model(options.model_dir, device, kF32);
  }
  Report report(options.every_tensor);
  const bool pin = options.pin_routing_always;
  if (all || options.cases == "batch") run_batch_case(report, *model, f32_model.get(), ref, bf16, pin);
  if (all || options.cases == "packed") run_packed_case(report, *model, f32_model.get(), ref, bf16, pin);
  if (all || options.cases == "trajectory") {
    run_trajectory_case(report, options.model_dir, device, precision, ref, bf16, pin);
  }
  std::printf("%d passed, %d failed\n", report.passed(), report.failed());
  return report.failed() == 0 ? 0 : 1;
}

std::vector<golden::RoutingChoice> trajectory_near_ties(const CheckGoldenOptions& options) {
  const Device device = parse_device(options.device);
  if (device.is_cuda()) ops::cuda::setup_cuda(device.index);
  const io::SafetensorsReader ref = io::SafetensorsReader::open(options.reference);
  const std::vector<std::vector<model::MicroBatch>> steps = trajectory_batches(ref, ref.tensor("traj.loss").numel());
  return closest_routing_choices(options.model_dir, device, steps, {}, golden::kReversedChoicesPerStep);
}

}  // namespace moetrain::cli
