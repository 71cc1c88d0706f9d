// defines: the fuzz targets: each feeds the bytes to one parser (and, when it accepts them, to what uses the result),
// lets moetrain::Error (a refusal with its message) pass and lets everything else escape to the fuzzer.
#include "fuzz/targets.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli/generate_command.h"
#include "cli/score_command.h"
#include "core/error.h"
#include "core/tensor.h"
#include "exact/wire_checks.h"
#include "io/job_config.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/hf_adapter.h"
#include "model/model_config.h"
#include "pipeline/generation.h"
#include "train/checkpoint.h"
#include "train/data/indexed_dataset.h"
#include "train/data/loader.h"
#include "train/data/prepare.h"

namespace moetrain::fuzz {

namespace {

template <class Parse>
void refusals_allowed(Parse&& parse) {
  try {
    parse();
  } catch (const Error&) {
    // A refusal with a message is a correct answer to bad input.
  }
}

// A folder of this process under the system's temporary folder, removed when the process exits: the targets that
// read files write the input there and read nothing else.
const std::string& scratch_folder() {
  struct Folder {
    std::string path;
    Folder() {
      path = (std::filesystem::temp_directory_path() / ("moetrain_fuzz_" + std::to_string(getpid()))).string();
      std::filesystem::create_directories(path);
    }
    ~Folder() {
      std::error_code error;
      std::filesystem::remove_all(path, error);
    }
  };
  static const Folder folder;
  return folder.path;
}

void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// The model folder of safetensors_index: a sharded set written by the engine (three small tensors, shards of at most
// 32 bytes of data: three shards and model.safetensors.index.json, the seed of the corpus).
const std::string& sharded_model_folder() {
  static const std::string folder = [] {
    const std::string path = scratch_folder() + "/model";
    std::vector<std::pair<std::string, Tensor>> tensors = {
        {"model.embed_tokens.weight", Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, {4, 2})},
        {"model.norm.weight", Tensor::from_vector(std::vector<float>{1, 1}, {2})},
        {"lm_head.weight", Tensor::from_vector(std::vector<float>{8, 7, 6, 5, 4, 3, 2, 1}, {4, 2})}};
    io::write_safetensors_sharded(path, "model", tensors, 32);
    return path;
  }();
  return folder;
}

// The data of checkpoint_state: these paragraphs byte-tokenised as `moetrain data prepare --text` does (one document
// per paragraph), and the loader options of examples/tiny_moe (packed, shuffled, seed 1234, 4 rows of 128 tokens).
// The seeds' state.json come from `moetrain train` on the same data (tests/data/fuzz/README.md).
constexpr const char* kStateDocuments =
    "moetrain trains mixture-of-experts language models: a router sends every token to a few experts, and\n"
    "the experts' outputs are summed with the router's weights.\n"
    "\n"
    "Checkpoints hold the model, the optimizer moments, the data loader's position and a manifest.\n"
    "\n"
    "Short.\n"
    "\n"
    "The loader packs whole documents into rows; a document that does not fit is split and continues in the\n"
    "next micro-batch, so no target is lost and none is read twice. Resuming restores the position exactly:\n"
    "the same micro-batches follow, on any number of ranks.\n"
    "\n"
    "Every input from outside is checked before it is used: configs, job files, datasets, checkpoints and\n"
    "weights, each refusal with a message that names the file, what was expected and what was found.\n"
    "\n"
    "A.\n"
    "\n"
    "Experts are sharded over ranks; tokens travel to their experts and back in two all-to-all exchanges.\n"
    "\n"
    "The pipeline runs stages on different devices, with micro-batches flowing forwards and backwards.\n";

train::data::LoaderOptions state_loader_options() {
  static const std::string prefix = [] {
    const std::string text_file = scratch_folder() + "/documents.txt";
    std::ofstream(text_file, std::ios::trunc) << kStateDocuments;
    train::data::PrepareOptions prepare;
    prepare.output = scratch_folder() + "/documents";
    prepare.text_files = {text_file};
    train::data::prepare_dataset(prepare);
    return prepare.output;
  }();
  train::data::LoaderOptions options;
  options.sources = {{prefix, 1.0}};
  options.mode = "packed";
  options.shuffle = true;
  options.seq_len = 128;
  options.micro_batch = 4;
  options.seed = 1234;
  options.vocab_size = 257;
  return options;
}

}  // namespace

void safetensors_header(const uint8_t* data, size_t size) {
  // The first 8 bytes stand for the size of the data section behind the header; the rest is the header's text.
  uint64_t data_size = 0;
  for (size_t i = 0; i < 8 && i < size; ++i) data_size |= uint64_t(data[i]) << (8 * i);
  const size_t skip = size < 8 ? size : 8;
  const std::string_view text(reinterpret_cast<const char*>(data) + skip, size - skip);
  refusals_allowed([&] { io::parse_safetensors_header(text, data_size % (uint64_t(1) << 40), "fuzz.safetensors"); });
}

void model_config(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  refusals_allowed([&] {
    const model::ModelConfig config = model::parse_model_config(text, "fuzz/config.json");
    model::model_config_to_json(config);  // what an export would write must be writable
  });
}

void job_config(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  refusals_allowed([&] {
    const io::JobConfig config = io::parse_job_config(text, "fuzz/job.toml", {});
    io::job_config_to_toml(config);
  });
}

void megatron_index(const uint8_t* data, size_t size) {
  const size_t bin_bytes = size >= 2 ? size_t(data[0]) | size_t(data[1]) << 8 : 0;
  const size_t skip = size < 2 ? size : 2;
  const std::string prefix = scratch_folder() + "/fuzz";
  std::ofstream(prefix + ".bin", std::ios::binary | std::ios::trunc) << std::string(bin_bytes, '\0');
  write_bytes(prefix + ".idx", data + skip, size - skip);
  refusals_allowed([&] {
    const train::data::IndexedDataset dataset = train::data::IndexedDataset::open(prefix);
    for (int64_t i = 0; i < std::min<int64_t>(dataset.num_sequences(), 16); ++i) dataset.read(i);
  });
}

void safetensors_index(const uint8_t* data, size_t size) {
  const std::string folder = sharded_model_folder();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string index = folder + "/fuzz.safetensors.index.json";
  refusals_allowed([&] {
    io::parse_safetensors_index(text, index);
    // Accepted: the loader's view of it, the shards of the folder against the weight_map.
    write_bytes(index, data, size);
    const io::SafetensorsReader reader = io::SafetensorsReader::open(index);
    for (const std::string& name : reader.names()) reader.tensor(name);
  });
}

void checkpoint_manifest(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  refusals_allowed([&] { train::parse_checkpoint_manifest(text, "fuzz/step_00000004"); });
}

void checkpoint_state(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const train::data::LoaderOptions options = state_loader_options();
  refusals_allowed([&] {
    const nlohmann::json state = train::parse_checkpoint_state(text, "fuzz/checkpoint");
    if (state.at("data").is_null()) return;  // imported weights: the data starts from the beginning
    // As a resume: the loader takes the position, then the next micro-batches come from there.
    train::data::DataLoader loader(options);
    loader.restore(state.at("data"));
    for (int i = 0; i < 2; ++i) loader.next().validate(options.vocab_size);
  });
}

void checkpoint_shards(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  refusals_allowed([&] {
    const nlohmann::json layout = train::parse_shard_layout(text, "fuzz/step_00000004");
    // Accepted: the HF pieces cut out of their assembled parameter, as load_checkpoint does (small tensors only).
    for (const nlohmann::json& t : layout["tensors"]) {
      const Shape shape = t["shape"].get<Shape>();
      if (t["name"].get<std::string>().rfind("param/", 0) != 0 || shape_numel(shape) > (int64_t{1} << 16)) continue;
      const Tensor full = Tensor::zeros(shape, DType::F32);
      for (const nlohmann::json& entry : t["hf"]) model::extract_piece(full, model::piece_from_json(entry, "fuzz"));
    }
  });
}

void score_input(const uint8_t* data, size_t size) {
  const std::string path = scratch_folder() + "/score_input.safetensors";
  write_bytes(path, data, size);
  refusals_allowed([&] {
    // The vocabulary of examples/tiny_moe (bytes and an end of document).
    const cli::ScoreInput input = cli::read_score_input(path, 257);
    // Accepted: the micro-batches score runs, two rows each, and the exact lanes' metadata checks on them.
    for (int64_t row = 0, m = 0; row < input.rows(); row += 2, ++m) {
      const model::MicroBatch batch = cli::score_micro_batch(input, row, std::min(input.rows(), row + 2));
      batch.validate(257);
      exact::check_varlen_metadata(batch, input.row_tokens(), static_cast<int>(m));
    }
  });
}

void generate_input(const uint8_t* data, size_t size) {
  const std::string path = scratch_folder() + "/generate_input.safetensors";
  write_bytes(path, data, size);
  // A one-layer model with the tiny example's vocabulary: what generate validates against (its vocabulary and its
  // layers' decoding support).
  static const std::unique_ptr<model::CausalLm> tiny = std::make_unique<model::CausalLm>(model::parse_model_config(
      R"({"model_type": "qwen3_moe", "vocab_size": 257, "hidden_size": 16, "intermediate_size": 32,
          "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1, "norm_topk_prob": true, "rms_norm_eps": 1e-06,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 64,
          "tie_word_embeddings": false})",
      "fuzz/generate_model.json"));
  refusals_allowed([&] {
    cli::GenerateOptions options;
    options.max_new_tokens = 2;
    pipeline::validate_generation(*tiny, cli::read_generate_input(path, options));
  });
}

std::vector<std::pair<std::string, Target>> all_targets() {
  return {{"safetensors_header", &safetensors_header},
          {"safetensors_index", &safetensors_index},
          {"model_config", &model_config},
          {"job_config", &job_config},
          {"megatron_index", &megatron_index},
          {"checkpoint_manifest", &checkpoint_manifest},
          {"checkpoint_state", &checkpoint_state},
          {"checkpoint_shards", &checkpoint_shards},
          {"score_input", &score_input},
          {"generate_input", &generate_input}};
}

}  // namespace moetrain::fuzz
