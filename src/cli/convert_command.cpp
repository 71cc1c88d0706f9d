// defines: checkpoint <-> Hugging Face conversion.
#include "cli/convert_command.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "io/json_fields.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "train/checkpoint.h"

namespace moetrain::cli {

namespace {

constexpr uint64_t kMaxShardBytes = 5ull << 30;

std::string resolve_checkpoint(const std::string& path) {
  if (std::filesystem::exists(std::filesystem::path(path) / "manifest.json")) return path;
  const auto latest = train::find_latest_checkpoint(path);
  MT_CHECK(latest.has_value(), "convert: '{}' is neither a checkpoint folder nor a folder holding complete checkpoints",
           path);
  return *latest;
}

// An exclusive temporary file beside `path`, then a rename: an existing "<path>.tmp" symlink is never followed.
void write_text_atomically(const std::string& path, const std::string& text) {
  io::write_file_atomically(path, {{text.data(), text.size()}}, "convert");
}

}  // namespace

int run_export_hf(const std::string& checkpoint, const std::string& out_dir, DType dtype) {
  MT_CHECK(dtype == DType::F32 || dtype == DType::BF16, "convert: --dtype must be f32 or bf16 but is {}",
           dtype_name(dtype));
  const std::string path = resolve_checkpoint(checkpoint);
  const train::CheckpointData data = train::load_checkpoint(path);
  MT_CHECK(data.state.contains("model_config") && data.state.at("model_config").is_string(),
           "convert: checkpoint {} has no model_config in state.json", path);
  const model::ModelConfig config = model::parse_model_config(data.state.at("model_config").get<std::string>(), path);
  // Loading into a model validates every tensor against the config before anything is written.
  model::CausalLm model(config);
  model.params().load_hf_tensors(data.model);
  std::filesystem::create_directories(out_dir);
  std::vector<std::pair<std::string, Tensor>> tensors = model.params().export_hf();
  std::string config_json = model::model_config_to_json(config);
  if (dtype == DType::BF16) {
    for (auto& [name, tensor] : tensors) tensor = tensor.to(DType::BF16);
    nlohmann::json j = io::parse_json_object(config_json, "the exported config.json");
    j["dtype"] = "bfloat16";
    config_json = j.dump(2) + "\n";
  }
  const auto files = io::write_safetensors_sharded(out_dir, "model", tensors, kMaxShardBytes);
  write_text_atomically(out_dir + "/config.json", config_json);
  log_info("exported {} (step {}) to {}: config.json + {} {} safetensors file(s)", path, data.step, out_dir,
           files.size(), dtype_name(dtype));
  return 0;
}

int run_import_hf(const std::string& hf_dir, const std::string& checkpoint_dir) {
  const auto model = model::CausalLm::from_hf(hf_dir);
  train::CheckpointData data;
  data.step = 0;
  data.model = model->params().export_hf();
  for (const auto& spec : model->params().specs()) {
    data.optimizer.emplace_back("exp_avg/" + spec.name, Tensor::zeros(spec.shape, DType::F32));
    data.optimizer.emplace_back("exp_avg_sq/" + spec.name, Tensor::zeros(spec.shape, DType::F32));
  }
  data.state = {{"step", 0},
                {"optimizer_steps", 0},
                {"data", nullptr},
                {"model_config", model::model_config_to_json(model->config())}};
  const std::string path = train::save_checkpoint(checkpoint_dir, data, 1 << 30);
  log_info("imported {} as {}", hf_dir, path);
  return 0;
}

void add_convert_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* convert = app.add_subcommand("convert", "Export a checkpoint to a Hugging Face folder, or import one");
  auto checkpoint = std::make_shared<std::string>();
  auto hf = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto dtype = std::make_shared<std::string>("f32");
  auto* from_checkpoint =
      convert->add_option("--checkpoint", *checkpoint, "checkpoint folder (or checkpoint.dir) to export");
  auto* from_hf = convert->add_option("--hf", *hf, "Hugging Face folder to import as a step-0 checkpoint");
  from_checkpoint->excludes(from_hf);
  convert->add_option("--out", *out, "output folder (HF folder for export, checkpoint.dir for import)")->required();
  convert->add_option("--dtype", *dtype, "export: the tensors' dtype, f32 (default) or bf16");
  convert->callback([checkpoint, hf, out, dtype, &command] {
    command = [checkpoint, hf, out, dtype] {
      MT_CHECK(!checkpoint->empty() || !hf->empty(), "convert: give --checkpoint DIR (export) or --hf DIR (import)");
      MT_CHECK(*dtype == "f32" || *dtype == "bf16", "convert: --dtype must be f32 or bf16 but is '{}'", *dtype);
      MT_CHECK(!checkpoint->empty() || *dtype == "f32",
               "convert: --dtype applies to an export (--checkpoint); an import keeps the folder's values in f32");
      return checkpoint->empty() ? run_import_hf(*hf, *out)
                                 : run_export_hf(*checkpoint, *out, *dtype == "bf16" ? DType::BF16 : DType::F32);
    };
  });
}

}  // namespace moetrain::cli
