// defines: `moetrain check-golden`: runs a model against a Hugging Face reference dump (the
// format of shared/golden, see tests/data/README.md) and reports, per checked tensor group, the
// worst relative error and the tensor it came from, then "N passed, M failed".
#pragma once

#include <string>

namespace moetrain::cli {

struct CheckGoldenOptions {
  std::string model_dir;
  std::string reference;  // reference.safetensors
  std::string device = "cpu";
  std::string dtype = "f32";  // compute dtype: f32, or bf16 on CUDA (fp32 masters, looser thresholds)
  std::string cases = "all";  // batch | packed | trajectory | all
};

// Returns the process exit code: 0 when every check passed.
int run_check_golden(const CheckGoldenOptions& options);

}  // namespace moetrain::cli
