// defines: the entry point of the `moetrain` program; commands live in src/cli/commands.*.
#include <cstdio>

#include "cli/commands.h"

int main(int argc, char** argv) { return moetrain::cli::run_main(argc, argv); }
