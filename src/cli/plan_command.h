// defines: `moetrain plan --config job.toml [--world N] [--section.key=value ...]`: the memory planner
// (train/memory_plan.h) on the job's mesh, printed before anything runs: per rank kind the predicted peak and its
// parts, the parameters per rank and the FLOPs per step.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace moetrain::cli {

struct PlanOptions {
  std::string config;
  int64_t world = 0;  // 0: dist.local_ranks when set, else the smallest world of the mesh (pp x cp x ep)
  std::vector<std::string> overrides;
};

int run_plan(const PlanOptions& options);

void add_plan_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
