// defines: the fuzz targets: each feeds the bytes to one parser, lets moetrain::Error (a refusal with its message)
// pass and lets everything else escape to the fuzzer.
#include "fuzz/targets.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/job_config.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "train/data/indexed_dataset.h"

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
  static const std::string folder = [] {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("moetrain_fuzz_idx_" + std::to_string(getpid()))).string();
    std::filesystem::create_directories(path);
    return path;
  }();
  const size_t bin_bytes = size >= 2 ? size_t(data[0]) | size_t(data[1]) << 8 : 0;
  const size_t skip = size < 2 ? size : 2;
  const std::string prefix = folder + "/fuzz";
  std::ofstream(prefix + ".bin", std::ios::binary | std::ios::trunc) << std::string(bin_bytes, '\0');
  std::ofstream(prefix + ".idx", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data) + skip, static_cast<std::streamsize>(size - skip));
  refusals_allowed([&] {
    const train::data::IndexedDataset dataset = train::data::IndexedDataset::open(prefix);
    for (int64_t i = 0; i < std::min<int64_t>(dataset.num_sequences(), 16); ++i) dataset.read(i);
  });
}

std::vector<std::pair<std::string, Target>> all_targets() {
  return {{"safetensors_header", &safetensors_header},
          {"model_config", &model_config},
          {"job_config", &job_config},
          {"megatron_index", &megatron_index}};
}

}  // namespace moetrain::fuzz
