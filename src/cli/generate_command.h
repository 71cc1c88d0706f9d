// defines: `moetrain generate --config job.toml --input prompts.safetensors --out FILE --max-new-tokens N
// [--temperature T] [--seed S] [--section.key=value ...]`: autoregressive sampling from the job's model with a KV
// cache (pipeline/generation.h). In exact mode its log-probs are the bytes `score` computes for the same sequences
// (docs/generation.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "pipeline/generation.h"

namespace moetrain::cli {

struct GenerateOptions {
  std::string config_path;
  std::string input;
  std::string out;
  int64_t max_new_tokens = 0;
  double temperature = 0.0;
  uint64_t seed = 0;
  std::vector<std::string> overrides;  // --section.key=value
};

// The input file, a safetensors file with exactly these tensors:
//   input_ids  int32 [B, P], B >= 1 rows of P >= 1 tokens;
//   lengths    (optional) int32 [B], row b's prompt is its first lengths[b] tokens, 1 <= lengths[b] <= P (absent:
//              every row is a whole prompt). Prompt tokens must lie in the vocabulary; the rest of a row is ignored.
// The request's sampling fields are the options'.
pipeline::GenerationRequest read_generate_input(const std::string& path, const GenerateOptions& options);

int run_generate(const GenerateOptions& options);
void add_generate_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
