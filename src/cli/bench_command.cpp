// defines: the bench command.
#include "cli/bench_command.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/train_command.h"
#include "core/allocator.h"
#include "core/error.h"
#include "dist/mesh.h"
#include "io/job_config.h"
#include "ops/cuda/energy.h"
#include "ops/cuda/runtime.h"
#include "ops/op_profile.h"
#include "train/fully_sharded.h"
#include "train/launch.h"
#include "train/trainer.h"

namespace moetrain::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t bytes_of(const std::vector<Tensor>& tensors) {
  int64_t n = 0;
  for (const Tensor& t : tensors) {
    if (t.defined()) n += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  }
  return n;
}

// The long-lived tensors of training by role; whatever else the peak held is activations and
// workspaces.
nlohmann::json memory_breakdown(const train::Trainer& trainer, int64_t peak) {
  const model::ParameterStore& params = trainer.model().params();
  int64_t copies = 0, masters = 0, grads = 0;
  if (const train::FullyShardedModel* sharded = trainer.sharded_model()) {
    // ZeRO-3: the long-lived tensors are this rank's shards; the full weights and gradients gathered around each
    // layer count as workspace.
    copies = bytes_of(sharded->compute_shards());
    masters = bytes_of(sharded->master_shards());
    grads = bytes_of(sharded->grad_shards());
  } else {
    for (const auto& spec : params.specs()) {
      const Tensor w = params.weight(spec.name);
      if (w.dtype() != params.param(spec.name).dtype())
        copies += w.numel() * static_cast<int64_t>(dtype_size(w.dtype()));
    }
    masters = bytes_of(params.all_params());
    grads = bytes_of(params.all_grads());
  }
  const int64_t optimizer = bytes_of(trainer.optimizer().exp_avg()) + bytes_of(trainer.optimizer().exp_avg_sq());
  const int64_t activations = peak - copies - masters - grads - optimizer;
  return {{"compute_weights_GiB", copies / kGiB},
          {"masters_GiB", masters / kGiB},
          {"optimizer_state_GiB", optimizer / kGiB},
          {"gradients_GiB", grads / kGiB},
          {"activations_and_workspace_GiB", activations / kGiB},
          {"peak_GiB", peak / kGiB}};
}

// The GPU's power reading once its work is done (nullopt on the CPU or where NVML reads nothing).
std::optional<ops::cuda::GpuPowerReading> gpu_power_when_idle(Device device) {
  if (!device.is_cuda()) return std::nullopt;
  ops::cuda::synchronize(device);
  return ops::cuda::read_gpu_power();
}

// Prints the profiled steps' device time by op family and by op, and adds it to the results (`time_per_step_s`,
// `time_per_op_s`, `profiled_step_s`): `seconds` is those steps' wall time, whatever the ops do not cover is "other".
void print_time_by_op(const ops::OpTimes& op_times, double seconds, int64_t steps, nlohmann::json& result) {
  const auto per_step = [steps](double s) { return s / static_cast<double>(steps); };
  std::printf("bench: time by op over %lld profiled steps of %.3f s (their op timers included)\n",
              static_cast<long long>(steps), per_step(seconds));
  std::vector<std::pair<double, std::string>> families;
  double device_seconds = 0.0;
  for (const auto& [family, s] : op_times.by_family) {
    families.emplace_back(s, family);
    device_seconds += s;
  }
  std::sort(families.rbegin(), families.rend());
  nlohmann::json time_json = nlohmann::json::object();
  nlohmann::json op_json = nlohmann::json::object();
  for (const auto& [s, family] : families) {
    std::printf("bench: time %-14s %8.2f ms/step %5.1f%%\n", family.c_str(), 1e3 * per_step(s), 100.0 * s / seconds);
    time_json[family] = per_step(s);
    // The family's ops, the slowest first, where it has more than one.
    std::vector<std::pair<double, std::string>> ops_of_family;
    for (const auto& [op, op_seconds] : op_times.by_op.at(family)) {
      ops_of_family.emplace_back(op_seconds, op);
      op_json[family][op] = per_step(op_seconds);
    }
    std::sort(ops_of_family.rbegin(), ops_of_family.rend());
    if (ops_of_family.size() < 2) continue;
    for (const auto& [op_seconds, op] : ops_of_family) {
      std::printf("bench:      %-37s %8.2f ms/step\n", op.c_str(), 1e3 * per_step(op_seconds));
    }
  }
  const double other = per_step(std::max(0.0, seconds - device_seconds));
  std::printf("bench: time %-14s %8.2f ms/step %5.1f%% (host work and gaps between ops)\n", "other", 1e3 * other,
              100.0 * other / per_step(seconds));
  time_json["other"] = other;
  result["time_per_step_s"] = time_json;
  result["time_per_op_s"] = op_json;
  result["profiled_step_s"] = per_step(seconds);
}

}  // namespace

std::optional<nlohmann::json> energy_of_timed_steps(const ops::cuda::GpuPowerReading& before,
                                                    const ops::cuda::GpuPowerReading& after, double wall_seconds,
                                                    int64_t steps) {
  const double joules = after.energy_joules - before.energy_joules;
  if (!(joules > 0.0)) return std::nullopt;
  return nlohmann::json{{"joules_per_step", joules / static_cast<double>(steps)},
                        {"window_s", wall_seconds},
                        {"mean_power_W", joules / wall_seconds},
                        {"power_limit_W", after.power_limit_watts},
                        {"sm_clock_MHz_at_end", after.sm_clock_mhz}};
}

int run_bench(const BenchOptions& options) {
  MT_CHECK(options.warmup >= 0 && options.steps >= 1,
           "bench: expected --warmup >= 0 and --steps >= 1 but found {} and {}", options.warmup, options.steps);
  MT_CHECK(options.profile_steps >= -1, "bench: expected --profile-steps >= 0 (or -1: as many as --steps) but found {}",
           options.profile_steps);
  const int64_t profile_steps = options.profile_steps < 0 ? options.steps : options.profile_steps;
  std::vector<std::string> overrides = options.overrides;
  overrides.push_back("checkpoint.dir=");  // a benchmark neither resumes nor writes checkpoints
  // It times training steps only: no held-out evaluation, no TensorBoard events.
  overrides.push_back("eval.every=0");
  overrides.push_back("metrics.tensorboard=");
  overrides.push_back(fmt::format("train.steps={}", options.warmup + options.steps + profile_steps));
  io::JobConfig config = io::load_job_config(options.config, overrides);
  // torchrun & co.: one GPU per process; a job that cannot fit its device is refused before it allocates.
  dist::Mesh* mesh = train::setup_process_mesh(config, true);
  const int world = mesh == nullptr ? 1 : mesh->shape().world();
  train::Trainer trainer(config, mesh);
  const DeviceKind kind = trainer.model().device().kind;
  // Start-up (ZeRO-3 builds the whole model once before it shards it) and training steps peak apart.
  const int64_t startup_peak = memory_stats(kind).peak_bytes;
  reset_peak_memory(kind);
  if (options.warmup > 0) trainer.run(options.warmup);
  // The timed steps run as training runs, without the op timers: their events between the ops stretch a step (a few
  // thousand ops a step on a GPU), so the time by op comes from the profiled steps after them.
  const Device device = trainer.model().device();
  const std::optional<ops::cuda::GpuPowerReading> power_before = gpu_power_when_idle(device);
  const auto wall_before = std::chrono::steady_clock::now();
  const train::TrainSummary timed = trainer.run(options.steps);
  const std::optional<ops::cuda::GpuPowerReading> power_after = gpu_power_when_idle(device);
  const double wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_before).count();
  ops::set_op_profiling(true);
  ops::collect_op_times();  // drop anything recorded before the profiled steps
  const train::TrainSummary profiled = profile_steps > 0 ? trainer.run(profile_steps) : train::TrainSummary{};
  ops::set_op_profiling(false);
  const ops::OpTimes op_times = ops::collect_op_times();
  const double profiled_seconds =
      std::accumulate(profiled.step_seconds.begin(), profiled.step_seconds.end(), 0.0);

  const double seconds = std::accumulate(timed.step_seconds.begin(), timed.step_seconds.end(), 0.0);
  const double tokens =
      static_cast<double>(std::accumulate(timed.step_tokens.begin(), timed.step_tokens.end(), int64_t{0}));
  const double tokens_per_s = tokens / seconds;
  const double tokens_per_s_per_gpu = tokens_per_s / world;
  const double tflops = tokens_per_s_per_gpu * trainer.flops_per_token() / 1e12;  // per GPU
  const double mfu = kind == DeviceKind::CUDA ? tflops / 989.0 : 0.0;
  const int64_t peak = memory_stats(kind).peak_bytes;

  nlohmann::json result = {{"model", trainer.model().config().model_type},
                           {"layers", trainer.model().config().num_hidden_layers},
                           {"parameters", trainer.model().params().num_parameters()},
                           {"compute_dtype", config.model.compute_dtype},
                           {"device", config.model.device},
                           {"tokens_per_step", tokens / static_cast<double>(options.steps)},
                           {"timed_steps", options.steps},
                           {"step_s", seconds / static_cast<double>(options.steps)},
                           {"profiled_steps", profile_steps},
                           {"tokens_per_s", tokens_per_s},
                           {"ranks", world},
                           {"tokens_per_s_per_gpu", tokens_per_s_per_gpu},
                           {"model_tflops", tflops},
                           {"mfu_vs_989", mfu},
                           {"flops_per_token", trainer.flops_per_token()},
                           {"memory", memory_breakdown(trainer, peak)},
                           {"startup_peak_GiB", startup_peak / kGiB}};
  if (kind == DeviceKind::CUDA) result["cudnn_version"] = ops::cuda::cudnn_runtime_version();
  if (power_before && power_after) {
    if (auto energy = energy_of_timed_steps(*power_before, *power_after, wall_seconds, options.steps)) {
      result["energy"] = *energy;
    } else {
      result["energy_not_measured"] = fmt::format(
          "the GPU's energy counter did not advance over the {:.3f} s of the timed steps; time more --steps",
          wall_seconds);
    }
  }
  if (mesh != nullptr && mesh->rank() != 0) return 0;  // the reductions gave every rank the same figures
  std::printf("bench: %d rank(s)%s\n", world, mesh == nullptr ? "" : (", mesh " + mesh->shape().str()).c_str());
  std::printf("bench: %s, %lld layers, %lld parameters, %s compute on %s\n", result["model"].get<std::string>().c_str(),
              static_cast<long long>(result["layers"].get<int64_t>()),
              static_cast<long long>(result["parameters"].get<int64_t>()), config.model.compute_dtype.c_str(),
              config.model.device.c_str());
  if (kind == DeviceKind::CUDA) std::printf("bench: cuDNN %d at run time\n", ops::cuda::cudnn_runtime_version());
  std::printf(
      "bench: %.0f tokens/step, %.3f s/step over %lld steps: %.1f tokens/s (%.1f per GPU), %.1f model TFLOP/s "
      "per GPU, MFU %.1f%%\n",
      tokens / static_cast<double>(options.steps), seconds / static_cast<double>(options.steps),
      static_cast<long long>(options.steps), tokens_per_s, tokens_per_s_per_gpu, tflops, 100.0 * mfu);
  std::printf(
      "bench: memory peak %.2f GiB = compute weights %.2f + masters %.2f + optimizer state %.2f + gradients "
      "%.2f + activations and workspace %.2f (start-up peak %.2f GiB)\n",
      peak / kGiB, result["memory"]["compute_weights_GiB"].get<double>(), result["memory"]["masters_GiB"].get<double>(),
      result["memory"]["optimizer_state_GiB"].get<double>(), result["memory"]["gradients_GiB"].get<double>(),
      result["memory"]["activations_and_workspace_GiB"].get<double>(), startup_peak / kGiB);
  if (result.contains("energy")) {
    const nlohmann::json& e = result["energy"];
    std::printf(
        "bench: energy %.1f J/step (this GPU, over %.2f s), mean power %.0f W against a limit of %.0f W, SM "
        "clock %d MHz at the end\n",
        e["joules_per_step"].get<double>(), e["window_s"].get<double>(), e["mean_power_W"].get<double>(),
        e["power_limit_W"].get<double>(), e["sm_clock_MHz_at_end"].get<int>());
  }
  if (result.contains("energy_not_measured"))
    std::printf("bench: energy not measured: %s\n", result["energy_not_measured"].get<std::string>().c_str());
  if (profile_steps > 0) {
    print_time_by_op(op_times, profiled_seconds, profile_steps, result);
  }
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    MT_CHECK(out.good(), "bench: cannot write {}", options.out);
    out << result.dump(1) << "\n";
  }
  return 0;
}

void add_bench_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* bench = app.add_subcommand("bench", "Measure a job's training step (tokens/s, MFU, memory, time by op)");
  auto options = std::make_shared<BenchOptions>();
  bench->add_option("--config", options->config, "job TOML file")->required();
  bench->add_option("--warmup", options->warmup, "untimed steps first")->capture_default_str();
  bench->add_option("--steps", options->steps, "timed steps")->capture_default_str();
  bench->add_option("--profile-steps", options->profile_steps,
                    "steps after the timed ones that time each op (-1: as many as --steps; 0: none)")
      ->capture_default_str();
  bench->add_option("--out", options->out, "write the results as JSON here");
  bench->allow_extras();
  bench->callback([bench, options, &command] {
    options->overrides = collect_overrides(bench->remaining());
    command = [options] { return run_bench(*options); };
  });
}

}  // namespace moetrain::cli
