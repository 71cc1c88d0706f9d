// defines: how a training job takes its ranks: one process alone, N thread ranks in this process
// (dist.local_ranks, CPU), or this process's rank of a world started by torchrun, srun or mpirun
// (one process per GPU, NCCL; the launcher's environment names the rank, the world and the master
// address). The mesh is resolved from parallel.* before anything else runs.
#pragma once

#include "io/job_config.h"
#include "train/trainer.h"

namespace moetrain::dist {
class Mesh;
}

namespace moetrain::train {

// When a launcher started several processes: connects this one to the NCCL world, sets the
// process-wide mesh, points `config` at this process's GPU (cuda:LOCAL_RANK) and returns the mesh.
// Null for a process alone.
dist::Mesh* setup_process_mesh(io::JobConfig& config);

// Trains `config` on the ranks the launch gives; returns the first rank's summary (thread ranks) or
// this process's.
TrainSummary run_training_job(const io::JobConfig& config);

}  // namespace moetrain::train
