// defines: resumable checkpoints on disk: <dir>/step_<8-digit step>/ with the model and optimizer
// tensors, the caller's state JSON and job config, and a manifest (sizes and FNV-1a 64 hashes) that
// is written last, so a checkpoint either exists complete or is ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace moetrain::train {

// Layout of one checkpoint folder <dir>/step_<step as %08d>/:
//   model.safetensors      the caller's `model` tensors (e.g. HF-named weights), in the given order
//   optimizer.safetensors  the caller's `optimizer` tensors (e.g. moments), in the given order
//   state.json             the caller's `state` (step, RNG, data-loader position, ...)
//   config.toml            the caller's `config_toml` text (the resolved job config)
//   manifest.json          written last: {"format": "moetrain-checkpoint", "version": 1, "step": N,
//                          "files": {name: {"bytes": size, "fnv1a64": 16 lowercase hex digits}}}
// One process writes to a `dir` at a time (rank 0): a save deletes every *.tmp-* folder it finds.
struct CheckpointData {
  int64_t step = 0;
  std::vector<std::pair<std::string, Tensor>> model;  // contiguous CPU tensors, unique non-empty names
  std::vector<std::pair<std::string, Tensor>> optimizer;
  nlohmann::json state;
  std::string config_toml;
};

// Writes <dir>/step_N.tmp-<pid>/..., fsyncs the files and the folder, renames it to <dir>/step_N
// (atomic on POSIX) and fsyncs <dir>; then deletes the oldest complete checkpoints beyond `keep`
// (never the one just written; keep == 0 keeps them all) and any stale *.tmp-* folders (left by a
// crash). An existing step_N is replaced by an atomic exchange once the new one is complete, so a
// crash at any point leaves either the old or the new step_N. Arguments are checked before anything
// is written (step >= 0, keep >= 0, tensors as above). Failing deletions of old checkpoints are
// logged as warnings: the new checkpoint is already safe. Returns the final path.
std::string save_checkpoint(const std::string& dir, const CheckpointData& data, int64_t keep);

// The newest COMPLETE checkpoint in dir: a step_N folder whose manifest.json parses, names this
// format and version, has the same step as the folder name, and lists the four files, which exist
// with the listed sizes (hashes are checked at load, not here, to keep start-up cheap). Newer folders
// that fail are skipped with a warning line naming the folder and the reason. Empty when dir does not
// exist or holds none; an error when dir is not a folder.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// Loads and fully verifies one checkpoint folder (manifest, sizes, FNV-1a 64 hashes of every file,
// the safetensors validity, state.json being JSON); errors name the file and the problem. Tensors are
// cloned (writable), in the order they were saved. When the folder is named step_<digits>, the
// manifest's step must match it.
CheckpointData load_checkpoint(const std::string& path);

// Steps of the complete checkpoints in dir (as find_latest_checkpoint judges them, without warnings),
// ascending. Empty when dir does not exist.
std::vector<int64_t> list_checkpoints(const std::string& dir);

// FNV-1a 64 of `bytes` (offset basis 0xcbf29ce484222325, prime 0x100000001b3), as checkpoints use.
uint64_t fnv1a64(const void* bytes, size_t size);

}  // namespace moetrain::train
