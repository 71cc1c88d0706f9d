// defines: `moetrain check-golden`: runs a model against a Hugging Face reference dump (the
// format of shared/golden, see tests/data/README.md) and reports, per checked tensor group, the
// worst relative error and the tensor it came from (in bf16: against its bound from transformers' own
// bf16 error), then "N passed, M failed".
#pragma once

#include <string>
#include <vector>

#include "cli/check_golden_judge.h"

namespace moetrain::cli {

struct CheckGoldenOptions {
  std::string model_dir;
  std::string reference;  // reference.safetensors
  std::string device = "cpu";
  // Compute dtype: f32, or bf16 on CUDA (fp32 masters), judged against transformers' own bf16 error (bf16ref.*).
  std::string dtype = "f32";
  // The residual stream under bf16 compute: f32 (default), as the reference's autocast keeps it, or "compute" (bf16,
  // the engine's default recipe; model.residual_dtype). Under f32 compute both are f32.
  std::string residual = "f32";
  std::string cases = "all";  // batch | packed | trajectory | all
  // Under bf16 judgement, one line per tensor after each group's line (ours, the yardstick, the bound, the spread);
  // the batch and packed cases then always run their rounding ensemble (check_golden_judge.h), which otherwise runs
  // only when a bound is passed.
  bool every_tensor = false;
  // Tests only: judge an f32 run by the bf16 rules, so that everything of --dtype bf16 but its kernels runs on
  // the CPU (the command line never sets it).
  bool judge_as_bf16 = false;
  // Tests only: in bf16 judgement, run the routing-pinned pass of every MoE case even when our routing made no
  // flip (it runs only after flips otherwise), so that its path runs on the CPU.
  bool pin_routing_always = false;
};

// Returns the process exit code: 0 when every check passed.
int run_check_golden(const CheckGoldenOptions& options);

// Our f32 trajectory's top-k near ties on the reference's micro-batches, the closest of each step first, as the
// trajectory's reversal search tries them (check_golden_judge.h, RoutingChoice).
std::vector<golden::RoutingChoice> trajectory_near_ties(const CheckGoldenOptions& options);

}  // namespace moetrain::cli
