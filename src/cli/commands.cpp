// defines: the command table of the `moetrain` program. Every command's errors are caught here
// and printed as one message; the exit code is non-zero.
#include "cli/commands.h"

#include <cstdio>
#include <exception>
#include <functional>

#include <CLI/CLI.hpp>

#include "cli/bench_command.h"
#include "cli/check_golden.h"
#include "cli/convert_command.h"
#include "cli/data_command.h"
#include "cli/generate_command.h"
#include "cli/plan_command.h"
#include "cli/report_command.h"
#include "cli/score_command.h"
#include "cli/train_command.h"
#include "core/error.h"
#include "dist/mesh.h"

namespace moetrain::cli {

int run_main(int argc, char** argv) {
  CLI::App app{"moetrain: pre-training engine for Mixture-of-Experts language models"};
  app.require_subcommand(1);
  std::function<int()> command;

  CheckGoldenOptions golden;
  CLI::App* check = app.add_subcommand("check-golden", "Check the engine's math against a Hugging Face reference dump");
  check->add_option("--model", golden.model_dir, "HF model folder (config.json + safetensors)")->required();
  check->add_option("--reference", golden.reference, "reference.safetensors of the dump")->required();
  check->add_option("--device", golden.device, "cpu | cuda[:N]")->capture_default_str();
  check->add_option("--dtype", golden.dtype, "compute dtype: f32 | bf16 (CUDA)")->capture_default_str();
  check
      ->add_option("--residual", golden.residual,
                   "residual stream under bf16 compute: f32 (as the reference's autocast) | compute")
      ->capture_default_str();
  check->add_option("--case", golden.cases, "batch | packed | trajectory | all")->capture_default_str();
  check->add_flag("--every-tensor", golden.every_tensor,
                  "under bf16 judgement, print every tensor's error, yardstick, bound and rounding-ensemble spread "
                  "after its group's line (the ensemble then runs in every batch and packed case)");
  check->callback([&] { command = [&] { return run_check_golden(golden); }; });

  add_train_command(app, command);
  add_bench_command(app, command);
  add_data_command(app, command);
  add_convert_command(app, command);
  add_score_command(app, command);
  add_generate_command(app, command);
  add_report_command(app, command);
  add_plan_command(app, command);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    const int code = command();
    dist::teardown_mesh();  // a clean exit destroys the NCCL communicators while CUDA is still up
    return code;
  } catch (const Error& e) {
    std::fprintf(stderr, "moetrain: error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetrain: unexpected error: %s\n", e.what());
  }
  return 1;
}

}  // namespace moetrain::cli
