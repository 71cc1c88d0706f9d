// defines: the generate command: the input file, the job's model (checkpoint or model.init) and its exact admission,
// the decoding, and the atomic write of tokens and log-probs.
#include "cli/generate_command.h"

#include <filesystem>
#include <system_error>

#include "cli/score_command.h"
#include "cli/train_command.h"
#include "core/error.h"
#include "core/log.h"
#include "io/job_config.h"
#include "io/safetensors.h"
#include "train/exact_job.h"
#include "train/job_model.h"

namespace moetrain::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kInputIds = "input_ids";
constexpr const char* kLengths = "lengths";

// Paths first: the output's folder exists, it is not a folder, nor the input.
fs::path checked_out_path(const GenerateOptions& options) {
  MT_CHECK(!options.input.empty() && !options.out.empty(), "generate: --input and --out are both required");
  std::error_code ec;
  const fs::path out = fs::absolute(options.out, ec);
  MT_CHECK(!ec, "generate: --out {}: not a usable path ({})", options.out, ec.message());
  MT_CHECK(fs::is_directory(out.parent_path(), ec), "generate: --out {}: its folder {} does not exist", options.out,
           out.parent_path().string());
  MT_CHECK(!fs::is_directory(out, ec), "generate: --out {} is a folder; expected a file path", options.out);
  MT_CHECK(!fs::exists(options.input, ec) || !fs::equivalent(options.input, out, ec),
           "generate: --out {} is the input file; write the generation elsewhere", options.out);
  return out;
}

}  // namespace

pipeline::GenerationRequest read_generate_input(const std::string& path, const GenerateOptions& options) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  const std::string what = fmt::format("generate input {}", path);
  for (const std::string& name : file.names()) {
    MT_CHECK(name == kInputIds || name == kLengths,
             "{}: unexpected tensor '{}' (the input holds '{}' int32 [B, P] and optionally '{}' int32 [B])", what, name,
             kInputIds, kLengths);
  }
  MT_CHECK(file.contains(kInputIds), "{}: no tensor '{}' (expected int32 [B, P] prompt tokens)", what, kInputIds);
  pipeline::GenerationRequest request;
  request.input_ids = file.tensor(kInputIds).clone();
  const Tensor& ids = request.input_ids;
  MT_CHECK(ids.dtype() == DType::I32 && ids.dim() == 2 && ids.size(0) >= 1 && ids.size(1) >= 1,
           "{}: '{}' must be int32 [B, P] with B >= 1 and P >= 1 but is {}", what, kInputIds, ids.describe());
  const int64_t rows = ids.size(0);
  if (file.contains(kLengths)) {
    const Tensor lengths = file.tensor(kLengths).clone();
    MT_CHECK(lengths.dtype() == DType::I32 && lengths.dim() == 1 && lengths.size(0) == rows,
             "{}: '{}' must be int32 [B] with B = {} (the rows of '{}') but is {}", what, kLengths, rows, kInputIds,
             lengths.describe());
    request.lengths = lengths.to_vector<int32_t>();
  } else {
    request.lengths.assign(static_cast<size_t>(rows), static_cast<int32_t>(ids.size(1)));
  }
  request.max_new_tokens = options.max_new_tokens;
  request.temperature = options.temperature;
  request.seed = options.seed;
  return request;
}

int run_generate(const GenerateOptions& options) {
  // 1. Everything is validated before any weight is read or byte written.
  const io::JobConfig config = io::load_job_config(options.config_path, options.overrides);
  MT_CHECK(
      config.dist.local_ranks <= 1 && config.parallel.pp == 1 && config.parallel.ep == 1 && config.parallel.cp == 1,
      "generate: runs on one rank (parallel.pp = ep = cp = 1, dist.local_ranks = 1) but the job asks for pp {}, "
      "ep {}, cp {}, {} local ranks",
      config.parallel.pp, config.parallel.ep, config.parallel.cp, config.dist.local_ranks);
  const fs::path out_path = checked_out_path(options);
  std::unique_ptr<model::CausalLm> model = make_model_for_job(config);
  const pipeline::GenerationRequest request = read_generate_input(options.input, options);
  if (config.exact.enabled) {
    train::admit_exact_for_job(config, *model, train::job_partition(config, model->config(), 1),
                               1);  // throws listing every violation
  }
  // 2. Weights, the decoding, the write.
  load_job_weights(config, *model);
  model->set_exact(config.exact.enabled);
  log_info("generate: {} rows, prompts of up to {} tokens, {} new tokens, temperature {}, seed {}{}",
           request.input_ids.size(0), request.input_ids.size(1), request.max_new_tokens, request.temperature,
           request.seed, config.exact.enabled ? ", exact" : "");
  const pipeline::Generation generation = pipeline::generate(*model, request);
  io::write_safetensors(out_path.string(), {{"tokens", generation.tokens}, {"logprobs", generation.logprobs}},
                        {{"format", "moetrain-generate"}, {"exact", config.exact.enabled ? "true" : "false"}});
  log_info("generate: wrote {} (tokens i32 [{}, {}], logprobs f32 [{}, {}])", out_path.string(),
           generation.tokens.size(0), generation.tokens.size(1), generation.logprobs.size(0),
           generation.logprobs.size(1));
  return 0;
}

void add_generate_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* generate = app.add_subcommand(
      "generate",
      "Sample continuations of prompts from the job's model (newest checkpoint in checkpoint.dir, else model.init),\n"
      "with a KV cache. Input (safetensors): input_ids int32 [B, P]; optional lengths int32 [B] (row b's prompt is\n"
      "its first lengths[b] tokens). Output (safetensors): tokens int32 [B, P + N] (each prompt, its N new tokens,\n"
      "then -1) and logprobs f32 [B, N] (log p of each new token under the model, before temperature: what score\n"
      "reports; the same bytes in exact mode). Extra --section.key=value arguments override the job file.");
  auto options = std::make_shared<GenerateOptions>();  // kept alive by the callbacks below
  generate->add_option("--config", options->config_path, "job TOML file")->required();
  generate->add_option("--input", options->input, "safetensors file with input_ids [and lengths]")->required();
  generate->add_option("--out", options->out, "safetensors file to write (tokens, logprobs), atomically")->required();
  generate->add_option("--max-new-tokens", options->max_new_tokens, "N, tokens to generate per row (>= 1)")->required();
  generate->add_option("--temperature", options->temperature, "0: greedy; > 0: softmax(logits / T)")
      ->capture_default_str();
  generate->add_option("--seed", options->seed, "sampling seed (row b draws from its own stream)")
      ->capture_default_str();
  generate->allow_extras();
  generate->callback([generate, options, &command] {
    command = [generate, options] {
      GenerateOptions resolved = *options;
      resolved.overrides = collect_overrides(generate->remaining());
      return run_generate(resolved);
    };
  });
}

}  // namespace moetrain::cli
