// defines: `moetrain bench --config job.toml`: the training step of a job measured as the PyTorch
// baseline measures it (docs/design.md section 7): warm-up steps, then timed steps; prints tokens/s,
// model TFLOP/s, MFU, peak memory with a breakdown (weights, masters, optimizer state, gradients,
// activations), and the device time by op family; writes the same as JSON with --out.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace moetrain::cli {

struct BenchOptions {
  std::string config;
  int64_t warmup = 2;
  int64_t steps = 4;
  std::string out;  // JSON results; empty: none
  std::vector<std::string> overrides;
};

int run_bench(const BenchOptions& options);

void add_bench_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
