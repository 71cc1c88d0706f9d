// defines: how a model's decoder layers are cut into the 2P pipeline stages of DualPipeV, laid out
// in a V: rank r holds stage r (going down) and stage 2P - 1 - r (coming back), so rank 0 holds
// both the first stage (with the embedding) and the last (with the final norm and the head).
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"

namespace moetrain::pipeline {

struct StageLayers {
  int stage = 0;            // 0 .. 2P - 1 along the model
  int rank = 0;             // the pipeline rank that runs it: r for r < P, 2P - 1 - r after
  int64_t first_layer = 0;  // global decoder-layer indices [first_layer, end_layer)
  int64_t end_layer = 0;
  bool has_embedding = false;   // the token embedding (stage 0)
  bool has_final_norm = false;  // the final RMSNorm (last stage)
  bool has_head = false;        // the LM head and the loss (last stage)

  int64_t num_layers() const { return end_layer - first_layer; }
};

struct Partition {
  int pp = 1;                       // P, pipeline ranks
  std::vector<StageLayers> stages;  // 2P entries, in stage order

  // The two stages of `rank`: {rank, 2P - 1 - rank}.
  const StageLayers& down_stage(int rank) const { return stages.at(static_cast<size_t>(rank)); }
  const StageLayers& up_stage(int rank) const { return stages.at(stages.size() - 1 - static_cast<size_t>(rank)); }
};

// Balanced by cost: each decoder layer costs its forward+backward FLOPs per token; the embedding
// and the head (with the loss) are counted on the first and last stage. Stages are contiguous and
// each holds >= 1 layer; fails closed when the model has fewer than 2P layers.
Partition partition_balanced(const model::ModelConfig& config, int pp);

// Explicit cut points (parallel.pp_cuts): 2P - 1 strictly increasing layer indices in
// (0, num_layers); stage s holds layers [cut[s-1], cut[s]). Errors name the bad cut.
Partition partition_from_cuts(const model::ModelConfig& config, int pp, const std::vector<int64_t>& cuts);

}  // namespace moetrain::pipeline
