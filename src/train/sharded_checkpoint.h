// defines: the checkpoints of ZeRO-3 training (train/fully_sharded.h): every data rank writes its own slices of
// the masters and AdamW moments into one file of a sharded checkpoint folder (train/checkpoint.h), and resumes from
// its own file when the folder's layout is this mesh's, or from the assembled whole otherwise (another mesh, or a
// replicated checkpoint).
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "io/job_config.h"
#include "train/fully_sharded.h"
#include "train/optimizer.h"

namespace moetrain::dist {
class Mesh;
}

namespace moetrain::train {

// Collective over mesh.dp_ep(): rank 0 prepares and completes the folder <config.checkpoint.dir>/step_<step>,
// every rank writes its shard file. `state` becomes state.json. Returns the folder's path.
std::string save_sharded_checkpoint(const FullyShardedModel& sharded, const AdamW& optimizer, dist::Mesh& mesh,
                                    const io::JobConfig& config, int64_t step, const nlohmann::json& state);

// Loads checkpoint `path` into this rank's master, compute and moment shards and returns its state.json. A sharded
// checkpoint whose layout matches this rank's shards is read from this rank's file alone; any other (another
// world size or layout, or a replicated checkpoint) is read whole and sharded here. Everything is validated before
// any shard changes.
// `check_state` sees state.json first and throws to refuse it.
nlohmann::json resume_sharded_checkpoint(FullyShardedModel& sharded, AdamW& optimizer, dist::Mesh& mesh,
                                         const std::string& path,
                                         const std::function<void(const nlohmann::json&)>& check_state);

}  // namespace moetrain::train
