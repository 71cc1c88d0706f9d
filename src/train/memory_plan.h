// defines: the memory planner of a job (`moetrain plan`): before anything runs, the bytes each rank of the mesh will
// hold at its peak (compute weights, fp32 masters, AdamW state, gradients, the activations each micro-batch saves
// for its backward times how many micro-batches are alive at the peak, the transient workspace of the head and of
// the backward, ZeRO-3's gathered working set), its parameters and the step's FLOPs. The activations are counted
// tensor by tensor as the blocks allocate them (model/blocks/*.cpp), replayed through the executors' order (plain, or
// the DualPipeV op list of pipeline/dualpipev_schedule.h) and ZeRO-3's gather / release hooks (fully_sharded.cpp),
// so a miss against a measured peak points at a tensor, not at a factor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/job_config.h"

namespace moetrain::train {

// One kind of rank (all dp / ep ranks of a pp rank are alike).
struct RankMemory {
  std::string label;             // "every rank", "pp rank 0 (stages 0 and 3)"
  int64_t ranks = 1;             // how many ranks of the mesh this row describes
  int64_t held_parameters = 0;   // elements of the parameters this rank holds (shards under ZeRO-3)
  int64_t owned_parameters = 0;  // parameters this rank computes gradients for and updates
  // Bytes of the long-lived tensors.
  int64_t weights = 0;    // compute copies (bf16 matrices under bf16 compute; 0 under f32: the masters are read)
  int64_t masters = 0;    // fp32 parameters (shards under ZeRO-3)
  int64_t optimizer = 0;  // AdamW's two moments (f32 or bf16: optim.state_dtype)
  int64_t gradients = 0;  // fp32 gradients (shards under ZeRO-3, or the full ones accumulated over the step)
  // Activations: what one micro-batch keeps for its backward over this rank's layers (the sum of the retained records
  // of its stages), and how many micro-batches' worth are alive at the peak.
  int64_t activations_per_micro_batch = 0;
  double micro_batches_alive = 0.0;
  int64_t activations = 0;  // at the peak
  // Everything else alive at the peak: the head / loss workspace, the backward's temporaries, the batch tensors and,
  // under ZeRO-3, the gathered compute weights and the full gradient of the parts in flight.
  int64_t workspace = 0;
  int64_t step_peak = 0;     // the peak of a training step
  int64_t startup_peak = 0;  // the peak before the first step (ZeRO-3 builds the whole model before it shards it)
  int64_t peak() const { return step_peak > startup_peak ? step_peak : startup_peak; }
  bool activations_modeled = true;  // false: a token mixer the planner has no model of (its activations are missing)
  std::string note;
};

struct MemoryPlan {
  std::string mesh;  // "pp=1 dp=2 cp=1 ep=1"
  int world = 1;
  std::string executor;  // "plain" or "DualPipeV"
  std::string sharding;  // "ZeRO-3" or "replicated"
  std::string compute_dtype;
  std::string state_dtype;  // the AdamW moments' (optim.state_dtype)
  int64_t total_parameters = 0;
  int64_t tokens_per_micro_batch = 0;
  int64_t micro_batches_per_rank = 0;  // per step, per data-parallel (pipeline) replica
  int64_t tokens_per_step = 0;         // over the whole mesh
  double flops_per_token = 0.0;        // model FLOPs of training one token (model/flops.h)
  double flops_per_step = 0.0;         // over the whole mesh
  std::vector<RankMemory> ranks;
};

// The plan of `config` on `world` ranks (dp = world / (pp x cp x ep)). Refuses what the trainer refuses: a mesh the
// world does not divide, a global batch the data ranks cannot share, DualPipeV with fewer than 2 * pp micro-batches.
MemoryPlan plan_memory(const io::JobConfig& config, int world);

// A size as the plan prints it: "1.23 GiB", or "4.56 MiB" under a GiB.
std::string format_size(int64_t bytes);

// The plan as the text `moetrain plan` prints: a header and one table per rank kind, sizes in GiB (MiB when small).
std::string format_memory_plan(const MemoryPlan& plan);

}  // namespace moetrain::train
