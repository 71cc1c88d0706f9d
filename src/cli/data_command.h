// defines: `moetrain data prepare`: the command-line face of train::data::prepare_dataset (JSONL
// token ids, JSONL text or plain text into a Megatron indexed dataset). commands.cpp registers it
// through add_data_command.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

#include "train/data/prepare.h"

namespace moetrain::cli {

// The flags of `data prepare` are the fields of the library's options.
using DataPrepareOptions = train::data::PrepareOptions;

// Writes the dataset and prints a summary (documents, tokens, dtype, output files). Returns the
// process exit code (0); errors are thrown as moetrain::Error.
int run_data_prepare(const DataPrepareOptions& options);

// Registers `data prepare` and its flags on `app`; when it is the parsed command, its callback
// sets `command` to run it. The options live as long as `app` does.
void add_data_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
