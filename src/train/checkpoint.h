// defines: resumable checkpoints on disk: <dir>/step_<8-digit step>/ with the model and optimizer
// tensors, the caller's state JSON and job config, and a manifest (sizes and FNV-1a 64 hashes) that
// is written last, so a checkpoint either exists complete or is ignored.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
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

// The newest checkpoint of dir that loads: find_latest_checkpoint's candidates, newest first, each loaded with
// load_checkpoint; one that fails there (a file corrupted in place, keeping its size, so only its hash tells) is
// skipped with a warning naming the folder and the problem, and the next older one is tried. Empty when none loads.
std::optional<std::pair<std::string, CheckpointData>> load_latest_checkpoint(const std::string& dir);

// The step a checkpoint folder's name gives ("step_00000006": 6); empty for any other name.
std::optional<int64_t> checkpoint_folder_step(const std::string& folder_name);

// Steps of the complete checkpoints in dir (as find_latest_checkpoint judges them, without warnings),
// ascending. Empty when dir does not exist.
std::vector<int64_t> list_checkpoints(const std::string& dir);

// Sharded checkpoints (ZeRO-3, train/fully_sharded.h): the same folder, manifest, state.json and config.toml, but
// instead of model.safetensors and optimizer.safetensors, one shard-<rank>-of-<world>.safetensors per rank with its
// flat slices of every tensor, and shards.json, their layout:
//   {"world": N, "tensors": [{"name": "param/<internal name>" | "exp_avg/<...>" | "exp_avg_sq/<...>",
//     "shape": [...], "slices": [[first, count] for each rank],
//     "hf": [[HF name, [HF shape], element offset], ...] (param/ tensors: how they split into HF tensors)}]}
// Rank r's file holds, under each name, its `count` elements starting at flat element `first`; over the ranks the
// slices tile every tensor exactly. Saving is collective: rank 0 prepares the temporary folder, every rank writes
// its shard, rank 0 completes the folder (the caller puts a barrier between these and after). load_checkpoint
// assembles a sharded checkpoint into the full model (HF names) and optimizer tensors, so every reader works with
// either kind and on any mesh; load_checkpoint_shard reads one rank's part (resume on the same mesh).
void prepare_sharded_checkpoint(const std::string& dir, int64_t step);
void write_checkpoint_shard(const std::string& dir, int64_t step, int rank, int world,
                            const std::vector<std::pair<std::string, Tensor>>& tensors);
// `data` gives step, state and config_toml (its model and optimizer stay empty). Validates `layout` against the
// shard files before anything is published. Returns the final path.
std::string complete_sharded_checkpoint(const std::string& dir, const CheckpointData& data,
                                        const nlohmann::json& layout, int64_t keep);
bool is_sharded_checkpoint(const std::string& path);
// The number of shard files shards.json announces (not verified; 0 when it cannot be read).
int sharded_checkpoint_world(const std::string& path);

struct CheckpointShard {
  int64_t step = 0;
  nlohmann::json layout;  // shards.json
  nlohmann::json state;
  std::vector<std::pair<std::string, Tensor>> tensors;  // this rank's slices, by name
};
// Verifies the manifest, state.json, shards.json and rank `rank`'s file (hashes), and reads them.
CheckpointShard load_checkpoint_shard(const std::string& path, int rank);

// The checks of a checkpoint's text files, on their text, each as loading runs them; `folder` names the checkpoint
// folder in errors (a step_<N> name is compared with the step state.json gives), and no file is read.
// manifest.json: {"format": "moetrain-checkpoint", "version": 1, "step": N >= 0, "files": {plain file name:
// {"bytes": size, "fnv1a64": 16 lowercase hex digits}}}, listing state.json and config.toml, and model.safetensors and
// optimizer.safetensors unless it lists shards.json; at most 1 MiB.
struct CheckpointManifest {
  struct File {
    uint64_t bytes = 0;
    uint64_t hash = 0;  // FNV-1a 64
  };
  int64_t step = 0;
  std::map<std::string, File> files;
};
CheckpointManifest parse_checkpoint_manifest(std::string_view text, const std::string& folder);
// state.json: an object with "step" and "optimizer_steps" (non-negative int64, optimizer_steps <= step, step equal
// to the folder name's) and "data" (the data loader's state, train::data::DataLoader::restore checks it, or null).
void check_checkpoint_state(const nlohmann::json& state, const std::string& folder);
nlohmann::json parse_checkpoint_state(std::string_view text, const std::string& folder);
// shards.json (the layout above): world in [1, 2^20], per tensor a shape of at most 2^60 elements, one [first, count]
// slice per rank inside it, slices that tile it exactly, and for param/ tensors HF pieces inside it.
nlohmann::json parse_shard_layout(std::string_view text, const std::string& folder);

// The optimizer moment `name` ("exp_avg/<internal name>" or "exp_avg_sq/...") of a checkpoint's optimizer tensors,
// in the job's moment dtype `dtype` (optim.state_dtype): checked to be there with `shape` in f32 or bf16, and
// converted when the checkpoint kept it in the other one (bf16 -> f32 exactly, f32 -> bf16 rounded to nearest even,
// as ops::cast rounds); *converted is set then. The error names what was expected and found.
Tensor moment_for_job(const std::map<std::string, Tensor>& moments, const std::string& name, const Shape& shape,
                      DType dtype, const std::string& checkpoint, bool* converted);
// The line a resume logs when it converted the moments.
std::string moments_converted_line(const std::string& checkpoint, DType dtype);

// FNV-1a 64 of `bytes` (offset basis 0xcbf29ce484222325, prime 0x100000001b3), as checkpoints use.
uint64_t fnv1a64(const void* bytes, size_t size);

}  // namespace moetrain::train
