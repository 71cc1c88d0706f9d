// defines: the tiny example's model (examples/tiny_moe: 8 layers, H 128, 8 experts top-2) as a training job for the
// tests: synthetic tokens, no checkpoint, a quiet console, then the given section.key=value overrides. Header-only:
// the io layer it needs is linked by the test binaries that include it.
#pragma once

#include <string>
#include <vector>

#include "io/job_config.h"
#include "testing/test_data.h"

namespace moetrain::testing {

inline io::JobConfig tiny_moe_job(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"model.config=" + repo_path("examples/tiny_moe/config.json"), "data.mode=synthetic",
                                  "metrics.console_every=100"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return io::parse_job_config("", "tiny_moe_job", all);
}

}  // namespace moetrain::testing
