// defines: the command table of the `moetrain` program.
#include "cli/commands.h"

#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "core/error.h"

namespace moetrain::cli {

int run_main(int argc, char** argv) {
  CLI::App app{"moetrain: pre-training engine for Mixture-of-Experts language models"};
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}

}  // namespace moetrain::cli
