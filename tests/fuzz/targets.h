// defines: the fuzz targets, one per parser of untrusted input: the bytes of a safetensors file's header, a sharded
// set's model.safetensors.index.json, a model's config.json (every family through the registry), a job's TOML, a
// Megatron .idx, a checkpoint's manifest.json, state.json and shards.json, and the input files of `moetrain score`
// and `moetrain generate`.
// Each returns normally for an input the parser accepts or refuses with moetrain's Error (a clear message); anything
// else (another exception, a crash, a sanitizer report) is a finding. They serve the libFuzzer binaries
// (tests/fuzz/fuzzer_main.cpp, scripts/fuzz.sh), the replay of the committed corpus in the CPU test suite
// (tests/cli/fuzz_corpus_test.cpp) and its replay under ASan + UBSan in CI (tests/fuzz/replay_main.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::fuzz {

void safetensors_header(const uint8_t* data, size_t size);
// The index parsed (io::parse_safetensors_index); when it is accepted, also opened with SafetensorsReader in a
// temporary folder of the process that holds a small sharded set the engine wrote (three shards), and nothing else.
void safetensors_index(const uint8_t* data, size_t size);
void model_config(const uint8_t* data, size_t size);
void job_config(const uint8_t* data, size_t size);
// The first 2 bytes give the size of a zero-filled prefix.bin (up to 64 KiB); the rest is prefix.idx (Megatron's
// indexed dataset), written to a temporary folder of the process, opened, and its first sequences read.
void megatron_index(const uint8_t* data, size_t size);
// A checkpoint's manifest.json (train::parse_checkpoint_manifest).
void checkpoint_manifest(const uint8_t* data, size_t size);
// A checkpoint's state.json as a resume reads it (train::parse_checkpoint_state), then its "data" restored into a
// data loader over a small fixed dataset with examples/tiny_moe's loader options, and two micro-batches drawn.
void checkpoint_state(const uint8_t* data, size_t size);
// A sharded checkpoint's shards.json (train::parse_shard_layout); when accepted, the HF pieces of its small
// parameters cut out of a zero tensor of the parameter's shape, as loading does.
void checkpoint_shards(const uint8_t* data, size_t size);
// The --input file of `moetrain score` (a safetensors file), written to a temporary folder of the process and read
// with cli::read_score_input for a vocabulary of 257; when accepted, its micro-batches of 2 rows built and checked.
void score_input(const uint8_t* data, size_t size);
// The --input file of `moetrain generate` (a safetensors file), written to a temporary folder of the process, read
// with cli::read_generate_input and validated against the tiny example's model (vocabulary 257), as generate does
// before it decodes.
void generate_input(const uint8_t* data, size_t size);

// The targets by name (the function names above), for the replays and scripts/fuzz.sh.
using Target = void (*)(const uint8_t*, size_t);
std::vector<std::pair<std::string, Target>> all_targets();

}  // namespace moetrain::fuzz
