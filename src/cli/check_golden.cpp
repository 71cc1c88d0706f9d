// defines: the check-golden command: the batch, packed and trajectory cases of a reference dump, run through
// the engine and compared tensor by tensor (relative error ||ours - ref|| / ||ref||); check_golden_judge.h
// holds the judgement: fp32 thresholds, or in bf16 transformers' own bf16 error as the yardstick.
#include "cli/check_golden.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/check_golden_judge.h"
#include "core/error.h"
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

// bf16: our errors against transformers' own bf16 errors (bf16ref.<prefix>grad.<name>), tensor by tensor, with the
// MoE-block tensors of layers where our routing made near-tie flips excused when over their bound.
void judge_bf16_tensors(Report& report, const std::string& group, const std::string& label,
                        const std::vector<Judged>& tensors, const model::CausalLm& model, const RoutingCheck& routing,
                        const std::string& yardstick, const std::string& rule) {
  const golden::Excusal excusal = golden::excuse_flipped_blocks(
      tensors, golden::moe_block_names(model.params(), model.config(), routing.near_tie_layers));
  const std::string excused = golden::excused_line(label + "/excused", excusal);
  if (!excused.empty()) report.info(excused);
  report.judged(group, excusal.kept, yardstick, rule);
}

// `shadow`: in bf16, the same model in f32 on the same device. It stands in for the reference's routing where the
// dump has no router logits (the packed case): the f32 check holds it to transformers' router logits within 1e-5.
void run_forward_backward_case(Report& report, const std::string& label, const std::string& prefix,
                               model::CausalLm& model, model::CausalLm* shadow, const model::MicroBatch& batch,
                               const io::SafetensorsReader& ref, bool bf16) {
  const Thresholds th;
  model.params().zero_grads();
  model::ForwardObservation observed;
  const model::StepLoss step = pipeline::forward_backward(model, {batch}, 0, &observed);
  const std::string logits_key = prefix + "logits", loss_key = prefix + "loss";
  const double logits_error = relative_error(observed.logits[0], ref.tensor(logits_key));
  const double loss_error = relative_error(scalar_tensor(step.loss), ref.tensor(loss_key));
  const double theirs_logits = bf16 ? golden::theirs_error(ref, logits_key) : 0.0;
  if (bf16) {
    report.judged(label + "/logits", {judge_bf16(logits_key, logits_error, theirs_logits)}, "theirs", kBf16Rule);
    report.judged(label + "/loss", {judge_bf16(loss_key, loss_error, golden::theirs_loss_error(ref, prefix))}, "theirs",
                  kBf16Rule + ", theirs = CE of bf16ref." + logits_key);
  } else {
    report.group(label + "/logits", {{logits_key, logits_error}}, th.logits);
    report.group(label + "/loss", {{loss_key, loss_error}}, th.loss);
  }
  if (ref.contains(prefix + "num_tokens")) {
    const int64_t ref_count = ref.tensor(prefix + "num_tokens").to(DType::I64).item<int64_t>();
    report.line(ref_count == step.num_targets, fmt::format("{:<28} {} counted targets (reference {})",
                                                           label + "/num_tokens", step.num_targets, ref_count));
  }
  RoutingCheck routing;
  routing.explain_near_ties = bf16;
  // The batch case: the reference's router logits, when transformers returns them for the family. Otherwise (the
  // packed case, or a family without them) our f32 path stands in, in bf16 only.
  const bool dumped_router_logits = prefix.empty() && ref.contains("router_logits.0");
  if (model.config().is_moe() && !dumped_router_logits && shadow == nullptr) {
    if (prefix.empty())
      report.info(
          fmt::format("{:<28} the dump has no router logits for this family: routing is judged through the "
                      "logits and gradients",
                      label + "/router_logits"));
  } else if (model.config().is_moe()) {
    std::vector<Tensor> reference;
    if (dumped_router_logits) {
      // The routing check reads rows of the reference's shape; one that differs from ours (a header rewritten from
      // [96, 8] to [768, 1] keeps the element count) is refused before it is read.
      for (size_t i = 0; i < observed.router_logits[0].size(); ++i) {
        const std::string key = fmt::format("router_logits.{}", i);
        MT_CHECK(ref.contains(key), "check-golden: the reference {} has router_logits.0 but no '{}' ({} MoE layers)",
                 ref.path(), key, observed.router_logits[0].size());
        Tensor tensor = ref.tensor(key);
        MT_CHECK(tensor.shape() == observed.router_logits[0][i].shape(),
                 "check-golden: the reference {} has '{}' of shape {}, expected {} (tokens x experts, as the model "
                 "computes them)",
                 ref.path(), key, shape_str(tensor.shape()), shape_str(observed.router_logits[0][i].shape()));
        reference.push_back(std::move(tensor));
      }
    } else {
      model::ForwardObservation f32;
      pipeline::forward_only(*shadow, {batch}, &f32);
      reference = f32.router_logits[0];
    }
    const std::string source =
        dumped_router_logits ? "" : " (against our f32 path: the dump has no router logits here)";
    std::vector<std::pair<std::string, double>> errors;
    for (size_t i = 0; i < observed.router_logits[0].size(); ++i) {
      errors.emplace_back(fmt::format("{}router_logits.{}", prefix, i),
                          relative_error(observed.router_logits[0][i], reference.at(i)));
    }
    if (bf16) {
      // The dump has no bf16 router logits: the yardstick is transformers' bf16 error at the output of the same
      // forward, the logits, which the router logits (the same kind of bf16 matmul on the same residual stream)
      // are upstream of.
      std::vector<Judged> judged;
      for (const auto& [name, error] : errors) judged.push_back(judge_bf16(name, error, theirs_logits));
      report.judged(label + "/router_logits", judged, "theirs",
                    kBf16Rule + ", theirs = that of " + logits_key + source);
    } else {
      report.group(label + "/router_logits", errors, th.router_logits);
    }
    routing.add_pass(reference, observed.router_logits[0], model.config().num_experts_per_tok, batch.cu_seqlens_host);
    report.line(routing.ok(), fmt::format("{:<28} {}{}", label + "/routing", routing.summary(), source));
  }
  const auto errors = compare_named(model.params(), true, ref, prefix + "grad.", report, label);
  if (!bf16) {
    report.group(label + "/grads", errors, th.grads);
    return;
  }
  std::vector<Judged> judged;
  for (const auto& [name, error] : errors) {
    judged.push_back(judge_bf16(name, error, golden::theirs_error(ref, prefix + "grad." + name)));
  }
  judge_bf16_tensors(report, label + "/grads", label, judged, model, routing, "theirs", kBf16Rule);
}

void run_batch_case(Report& report, model::CausalLm& model, model::CausalLm* shadow, const io::SafetensorsReader& ref,
                    bool bf16) {
  const model::MicroBatch batch = model::MicroBatch::from_rows(ref.tensor("input_ids"), ref.tensor("targets"));
  run_forward_backward_case(report, "batch", "", model, shadow, batch, ref, bf16);
}

void run_packed_case(Report& report, model::CausalLm& model, model::CausalLm* shadow, const io::SafetensorsReader& ref,
                     bool bf16) {
  const model::MicroBatch batch =
      model::MicroBatch::packed(ref.tensor("packed.input_ids").clone(), ref.tensor("packed.targets").clone(),
                                ref.tensor("packed.cu_seqlens").clone());
  const auto ours = batch.position_ids.to_vector<int32_t>();
  const auto theirs = ref.tensor("packed.position_ids").to_vector<int32_t>();
  report.line(ours == theirs, fmt::format("{:<28} {} documents, positions restart per document: {}", "packed/positions",
                                          batch.num_documents(), ours == theirs ? "same as reference" : "DIFFERENT"));
  run_forward_backward_case(report, "packed", "packed.", model, shadow, batch, ref, bf16);
}

// One model stepping through the trajectory: AdamW as the reference's, the global-norm clip at 1.0.
struct Stepper {
  std::unique_ptr<model::CausalLm> model;
  std::unique_ptr<train::AdamW> optimizer;
  Device device;

  Stepper(const std::string& model_dir, Device d, DType dtype)
      : model(model::CausalLm::from_hf(model_dir, d, dtype)),
        optimizer(std::make_unique<train::AdamW>(model->params(), train::AdamWConfig{1e-3, 0.9, 0.95, 1e-8, 0.1})),
        device(d) {}
  // Returns the step's loss and the gradient norm before clipping.
  std::pair<double, double> step(const std::vector<model::MicroBatch>& batches) {
    model->params().zero_grads();
    const double loss = pipeline::forward_backward(*model, batches).loss;
    const double norm = ops::clip_by_global_norm(default_stream(device), model->params().all_grads(), 1.0);
    optimizer->step(1e-3);  // writes the bf16 compute copies too
    return {loss, norm};
  }
};

// In bf16 an f32 shadow of an MoE model steps alongside: the dump has no router logits for the trajectory, and
// the shadow's routing stands in for the reference's at every step (the f32 check holds the shadow's trajectory to
// the reference's).
void run_trajectory_case(Report& report, const std::string& model_dir, Device device, DType dtype,
                         const io::SafetensorsReader& ref, bool bf16) {
  const Thresholds th;
  Stepper ours(model_dir, device, dtype);
  std::unique_ptr<Stepper> shadow;
  if (bf16 && ours.model->config().is_moe()) shadow = std::make_unique<Stepper>(model_dir, device, DType::F32);
  std::map<std::string, Tensor> start;
  if (bf16) {
    for (auto& [name, tensor] : ours.model->params().export_hf_runtime(
             false, [&](const std::string& fused) { return ref.contains("traj.final." + fused); })) {
      start.emplace(name, std::move(tensor));
    }
  }
  RoutingCheck routing;
  routing.explain_near_ties = true;
  std::vector<Judged> router_errors;
  const double theirs_logits = shadow ? golden::theirs_error(ref, "logits") : 0.0;
  const Tensor ref_losses = ref.tensor("traj.loss").to(DType::F64);
  const Tensor ref_norms = ref.tensor("traj.grad_norm").to(DType::F64);
  const int64_t steps = ref_losses.numel();
  std::vector<double> losses, norms;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<model::MicroBatch> batches;
    for (int mb = 0;; ++mb) {
      const std::string key = fmt::format("traj.step{}.mb{}.", step, mb);
      if (!ref.contains(key + "input_ids")) break;
      batches.push_back(model::MicroBatch::from_rows(ref.tensor(key + "input_ids"), ref.tensor(key + "targets")));
    }
    MT_CHECK(!batches.empty(), "check-golden: trajectory step {} has no micro-batches in the reference", step);
    if (shadow) {
      // Router logits of this step's weights, from forward passes apart from the step itself (observing the
      // training pass would make it materialise the logits instead of its fused head).
      model::ForwardObservation ours_seen, f32_seen;
      pipeline::forward_only(*ours.model, batches, &ours_seen);
      pipeline::forward_only(*shadow->model, batches, &f32_seen);
      for (size_t mb = 0; mb < batches.size(); ++mb) {
        for (size_t i = 0; i < ours_seen.router_logits[mb].size(); ++i) {
          router_errors.push_back(judge_bf16(
              fmt::format("step{}.mb{}.router_logits.{}", step, mb, i),
              relative_error(ours_seen.router_logits[mb][i], f32_seen.router_logits[mb].at(i)), theirs_logits));
        }
        routing.add_pass(f32_seen.router_logits[mb], ours_seen.router_logits[mb],
                         ours.model->config().num_experts_per_tok, batches[mb].cu_seqlens_host,
                         fmt::format("step {} mb {} ", step, mb));
      }
      shadow->step(batches);
    }
    const auto [loss, norm] = ours.step(batches);
    losses.push_back(loss);
    norms.push_back(norm);
  }
  const double loss_error = relative_error(Tensor::from_vector(losses, {steps}), ref_losses);
  const double norm_error = relative_error(Tensor::from_vector(norms, {steps}), ref_norms);
  const auto final_weight_errors = [&] {
    return compare_named(ours.model->params(), false, ref, "traj.final.", report, "trajectory");
  };
  if (!bf16) {
    report.group("trajectory/loss", {{"traj.loss", loss_error}}, th.trajectory_loss);
    report.group("trajectory/grad_norm", {{"traj.grad_norm", norm_error}}, th.trajectory_grad_norm);
    report.group("trajectory/final_weights", final_weight_errors(), th.trajectory_weights);
    return;
  }
  if (shadow) {
    const std::string source = " (against our f32 path stepping alongside: the dump has no router logits here)";
    report.judged("trajectory/router_logits", router_errors, "theirs",
                  kBf16Rule + ", theirs = that of the batch logits" + source);
    report.line(routing.ok(), fmt::format("{:<28} {}{}", "trajectory/routing", routing.summary(), source));
  }
  // No bf16ref for the trajectory: the batch case's yardstick (check_golden_judge.h says why).
  std::vector<std::string> grad_keys;
  for (const std::string& name : ref.names()) {
    if (name.rfind("grad.", 0) == 0) grad_keys.push_back(name);
  }
  report.judged("trajectory/loss", {judge_bf16("traj.loss", loss_error, golden::theirs_loss_error(ref, ""))}, "theirs",
                kBf16Rule + ", theirs = that of the batch loss");
  report.judged("trajectory/grad_norm",
                {judge_bf16("traj.grad_norm", norm_error, golden::theirs_error_over(ref, grad_keys))}, "theirs",
                kBf16Rule + ", theirs = that of all batch gradients together");
  std::vector<Judged> judged;
  for (const auto& [name, error] : final_weight_errors()) {
    const auto it = start.find(name);
    MT_CHECK(it != start.end(), "check-golden: no start weights for '{}'", name);
    const double update = relative_error(it->second, ref.tensor("traj.final." + name));  // ||W_0 - W_ref|| / ||W_ref||
    judged.push_back({name, error, update, golden::kTrajectoryUpdateShare * update + th.trajectory_weights});
  }
  judge_bf16_tensors(report, "trajectory/final_weights", "trajectory", judged, *ours.model, routing, "update",
                     fmt::format("{} x update + {:.0e}, update = ||W_ref - W_0|| / ||W_ref||",
                                 golden::kTrajectoryUpdateShare, th.trajectory_weights));
}

}  // namespace

int run_check_golden(const CheckGoldenOptions& options) {
  const std::set<std::string> known{"batch", "packed", "trajectory", "all"};
  MT_CHECK(known.count(options.cases), "check-golden: --case expects batch, packed, trajectory or all but found '{}'",
           options.cases);
  MT_CHECK(options.dtype == "f32" || options.dtype == "bf16",
           "check-golden: --dtype expects f32 or bf16 but found '{}'", options.dtype);
  const Device device = parse_device(options.device);
  const DType dtype = options.dtype == "bf16" ? DType::BF16 : DType::F32;
  MT_CHECK(dtype == DType::F32 || device.is_cuda(), "check-golden: --dtype bf16 needs --device cuda (found {})",
           device.str());
  if (device.is_cuda()) ops::cuda::setup_cuda(device.index);
  const bool bf16 = dtype == DType::BF16 || options.judge_as_bf16;
  const io::SafetensorsReader ref = io::SafetensorsReader::open(options.reference);
  auto model = model::CausalLm::from_hf(options.model_dir, device, dtype);
  std::printf("check-golden: %s (%s, %lld parameters) against %s on %s, %s compute%s\n", options.model_dir.c_str(),
              model->config().model_type.c_str(), static_cast<long long>(model->params().num_parameters()),
              options.reference.c_str(), device.str().c_str(), options.dtype.c_str(),
              bf16 ? ", judged against transformers' own bf16 error (bf16ref.*)" : "");
  const bool all = options.cases == "all";
  std::unique_ptr<model::CausalLm> shadow;
  if (bf16 && model->config().is_moe() && (all || options.cases == "packed")) {
    shadow = model::CausalLm::from_hf(options.model_dir, device, DType::F32);
  }
  Report report;
  if (all || options.cases == "batch") run_batch_case(report, *model, shadow.get(), ref, bf16);
  if (all || options.cases == "packed") run_packed_case(report, *model, shadow.get(), ref, bf16);
  if (all || options.cases == "trajectory") run_trajectory_case(report, options.model_dir, device, dtype, ref, bf16);
  std::printf("%d passed, %d failed\n", report.passed(), report.failed());
  return report.failed() == 0 ? 0 : 1;
}

}  // namespace moetrain::cli
