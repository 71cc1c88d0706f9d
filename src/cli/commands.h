// defines: `moetrain <command>`: parses the command line and runs one command. Returns the
// process exit code; errors are printed, never thrown past here.
#pragma once

namespace moetrain::cli {

int run_main(int argc, char** argv);

}  // namespace moetrain::cli
