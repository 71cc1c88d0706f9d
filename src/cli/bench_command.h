// defines: `moetrain bench --config job.toml`: the training step of a job measured as the PyTorch
// baseline measures it (docs/design.md section 7): warm-up steps, then timed steps; prints tokens/s,
// model TFLOP/s, MFU, peak memory with a breakdown (weights, masters, optimizer state, gradients,
// activations), and the device time by op family from profiled steps after the timed ones; writes the
// same as JSON with --out.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ops/cuda/energy.h"

namespace moetrain::cli {

struct BenchOptions {
  std::string config;
  int64_t warmup = 2;
  int64_t steps = 4;
  // Steps after the timed ones, run with the op timers for the time by op (-1: as many as `steps`; 0: none). The
  // timed steps never run them: their events between the ops stretch a step.
  int64_t profile_steps = -1;
  std::string out;  // JSON results; empty: none
  std::vector<std::string> overrides;
};

int run_bench(const BenchOptions& options);

// The timed steps' energy between two readings of the GPU (`energy` in the JSON): joules a step, the mean power over
// the wall time between them, the limit and the SM clock at the end (a step at the limit is as fast as the energy it
// spends allows). The driver updates its counter in steps and holds the limit as an average, so a window under a
// second or two scatters (DeepSeek-V2-Lite's 0.55 s: 89 and 106 J a step in two runs, the second's mean above the
// limit); more --steps make it steady. A window in which the counter did not advance at all (a few tens of
// milliseconds on an H100) measured nothing, which is not zero joules: nullopt.
std::optional<nlohmann::json> energy_of_timed_steps(const ops::cuda::GpuPowerReading& before,
                                                    const ops::cuda::GpuPowerReading& after, double wall_seconds,
                                                    int64_t steps);

void add_bench_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
