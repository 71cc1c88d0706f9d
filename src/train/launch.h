// defines: how a training job takes its ranks: one process alone, N thread ranks in this process
// (dist.local_ranks, on the CPU or sharing one GPU), or this process's rank of a world started by torchrun, srun or
// mpirun (one process per GPU, NCCL; the launcher's environment names the rank, the world and the master address). The
// mesh is resolved from parallel.* before anything else runs.
#pragma once

#include <functional>

#include "io/job_config.h"
#include "train/trainer.h"

namespace moetrain::dist {
class Mesh;
struct MeshShape;
}  // namespace moetrain::dist

namespace moetrain::train {

// When a launcher started several processes: connects this one to the NCCL world, sets the
// process-wide mesh, points `config` at this process's GPU (cuda:LOCAL_RANK) and returns the mesh.
// Null for a process alone. With `check_memory_fit` (a training job), a job whose planned peak does not fit this
// process's device (train/memory_fit.h) is refused first, before any rendezvous.
dist::Mesh* setup_process_mesh(io::JobConfig& config, bool check_memory_fit = false);

// The mesh of `config` on `world` ranks: parallel.pp, cp and ep from the job, dp = world / (pp x cp x ep). Refuses
// a world the mesh does not divide (dist::resolve_mesh).
dist::MeshShape job_mesh_shape(const io::JobConfig& config, int world);

// Runs `fn` on dist.local_ranks thread ranks of model.device (on a GPU they share it, dist/host_staged_communicator.h),
// each with its Mesh of job_mesh_shape built as run_training_job builds it (timeouts from dist.timeout_s); rethrows the
// first failure after every rank joined.
void run_on_thread_ranks(const io::JobConfig& config, const std::function<void(dist::Mesh&)>& fn);

// Trains `config` on the ranks the launch gives, once its planned peak is known to fit them; returns the first rank's
// summary (thread ranks) or this process's.
TrainSummary run_training_job(const io::JobConfig& config);

}  // namespace moetrain::train
