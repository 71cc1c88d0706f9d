// defines: `moetrain train --config job.toml [--section.key=value ...]`: resolves the job
// configuration (file, then overrides in order), prints it, and runs the Trainer.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace moetrain::cli {

// Turns the extra arguments of `train` into "section.key=value" overrides: "--a.b=v" and
// "--a.b v" are both accepted; anything else is an error naming the argument.
std::vector<std::string> collect_overrides(const std::vector<std::string>& extras);

int run_train(const std::string& config_path, const std::vector<std::string>& overrides);

void add_train_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
