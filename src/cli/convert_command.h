// defines: `moetrain convert`: export a checkpoint's weights as a Hugging Face folder
// (config.json + safetensors, sharded past 5 GB), or import a Hugging Face folder as a step-0
// checkpoint that training resumes from.
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

namespace moetrain::cli {

// `checkpoint`: a checkpoint folder (step_N) or a checkpoint.dir (its newest complete one).
int run_export_hf(const std::string& checkpoint, const std::string& out_dir);
int run_import_hf(const std::string& hf_dir, const std::string& checkpoint_dir);

void add_convert_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
