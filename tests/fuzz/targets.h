// defines: the fuzz targets, one per parser of untrusted input: the bytes of a safetensors file's header, a model's
// config.json (every family through the registry), a job's TOML and a Megatron .idx. Each returns normally for an input
// the parser accepts or refuses with moetrain's Error (a clear message); anything else (another exception, a crash, a
// sanitizer report) is a finding. They serve the libFuzzer binaries (tests/fuzz/*_fuzzer.cpp, scripts/fuzz.sh) and the
// replay of the committed corpus in the CPU test suite (tests/cli/fuzz_corpus_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::fuzz {

void safetensors_header(const uint8_t* data, size_t size);
void model_config(const uint8_t* data, size_t size);
void job_config(const uint8_t* data, size_t size);
// The first 2 bytes give the size of a zero-filled prefix.bin (up to 64 KiB); the rest is prefix.idx (Megatron's
// indexed dataset), written to a temporary folder of the process, opened, and its first sequences read.
void megatron_index(const uint8_t* data, size_t size);

// The targets by name ("safetensors_header", "model_config", "job_config", "megatron_index"), for the replay.
using Target = void (*)(const uint8_t*, size_t);
std::vector<std::pair<std::string, Target>> all_targets();

}  // namespace moetrain::fuzz
