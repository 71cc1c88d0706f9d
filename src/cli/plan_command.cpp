// defines: the plan command.
#include "cli/plan_command.h"

#include <cstdio>
#include <memory>

#include "cli/train_command.h"
#include "core/error.h"
#include "io/job_config.h"
#include "train/memory_plan.h"

namespace moetrain::cli {

int run_plan(const PlanOptions& options) {
  const io::JobConfig config = io::load_job_config(options.config, options.overrides);
  MT_CHECK(options.world >= 0, "plan: --world must be >= 1 but is {}", options.world);
  int64_t world = options.world;
  if (world == 0) {
    world = config.dist.local_ranks > 0 ? config.dist.local_ranks
                                        : config.parallel.pp * config.parallel.cp * config.parallel.ep;
  }
  const train::MemoryPlan plan = train::plan_memory(config, static_cast<int>(world));
  std::printf("%s", train::format_memory_plan(plan).c_str());
  std::fflush(stdout);
  return 0;
}

void add_plan_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* plan = app.add_subcommand(
      "plan", "Predict each rank's peak memory, its parameters and the FLOPs per step of a job, before it runs");
  auto options = std::make_shared<PlanOptions>();  // kept alive by the callback below
  plan->add_option("--config", options->config, "job TOML file")->required();
  plan->add_option("--world", options->world,
                   "ranks of the mesh (default: dist.local_ranks, else pp x cp x ep); dp = world / (pp x cp x ep)");
  plan->allow_extras();
  plan->callback([plan, options, &command] {
    command = [plan, options] {
      options->overrides = collect_overrides(plan->remaining());  // an unknown flag fails here, naming it
      return run_plan(*options);
    };
  });
}

}  // namespace moetrain::cli
