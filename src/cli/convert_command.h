// defines: `moetrain convert`: export a checkpoint's weights as a Hugging Face folder
// (config.json + safetensors, sharded past 5 GB; f32 or bf16), or import a Hugging Face folder as a step-0
// checkpoint that training resumes from.
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/dtype.h"

namespace moetrain::cli {

// `checkpoint`: a checkpoint folder (step_N) or a checkpoint.dir (its newest complete one). `dtype`: the exported
// tensors' dtype, f32 (the masters as they are) or bf16 (each rounded to nearest even, config.json's "dtype" then
// "bfloat16": the size and dtype of the released checkpoints).
int run_export_hf(const std::string& checkpoint, const std::string& out_dir, DType dtype = DType::F32);
int run_import_hf(const std::string& hf_dir, const std::string& checkpoint_dir);

void add_convert_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
