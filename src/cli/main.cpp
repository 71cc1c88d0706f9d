// defines: the entry point of the `moetrain` program; commands live in src/cli/commands.*.
#include <unistd.h>

#include <cstdlib>

#include "cli/commands.h"

int main(int argc, char** argv) {
  // The CPU backend's OpenMP threads spin between parallel regions by default; on a shared or
  // oversubscribed machine that spinning starves the thread doing the work (seen here: a training
  // step 6x slower). OpenMP reads its wait policy once, when the library loads, so the process
  // re-executes itself once with the policy set, unless the user chose one.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "passive", 1);
    ::execv("/proc/self/exe", argv);  // returns only on failure: then run with the default policy
  }
  return moetrain::cli::run_main(argc, argv);
}
