// defines: reading the launcher's environment (torchrun, Slurm, Open MPI, or none) into one
// LaunchEnv, and Slurm nodelist expansion. Processes are started by the user's launcher; this is
// how each one learns its rank, the world size and where rank 0's rendezvous listens.
//
// Precedence: torchrun (RANK set) > Open MPI (OMPI_COMM_WORLD_RANK set) > Slurm (SLURM_PROCID
// set) > none (a single-process world). Open MPI outranks Slurm because mpirun inside an sbatch
// script inherits the batch step's SLURM_PROCID = 0.
//
// MASTER_ADDR and MASTER_PORT are needed whenever world_size > 1 (Slurm alone derives MASTER_ADDR
// from the first host of SLURM_JOB_NODELIST), unless NCCL_COMM_ID is set: then NCCL's own
// bootstrap connects the ranks and no moetrain rendezvous runs. moetrain's rendezvous listens on
// MASTER_PORT + 1 (see rendezvous_port), because under torchrun the agent's TCPStore holds
// MASTER_PORT itself.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace moetrain::dist {

// Looks up an environment variable; std::nullopt when unset. Tests inject maps.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup process_env();  // reads the real environment (getenv)

struct LaunchEnv {
  std::string launcher = "none";  // "torchrun", "slurm", "mpi", "none"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // rank within this node: picks the GPU
  int local_world_size = 1;  // ranks on this node
  std::string master_addr;   // empty for a single-process world or when nccl_comm_id is set
  int master_port = 0;
  bool nccl_comm_id = false;  // NCCL_COMM_ID is set: NCCL bootstraps itself

  // Where rank 0's rendezvous listens: MASTER_PORT + 1.
  int rendezvous_port() const { return master_port + 1; }
};

// Validates as it reads: non-numbers, rank >= world, local_rank >= local_world_size, a missing
// MASTER_ADDR / MASTER_PORT when world > 1 are errors naming the variable and its value.
LaunchEnv read_launch_env(const EnvLookup& env);

// Expands a Slurm hostlist ("node[01-04,07],login1", "rack[1-2]-gpu[1-2]") into host names in
// order, keeping zero padding. Malformed lists (unbalanced brackets, reversed ranges) are errors.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);
std::string slurm_first_host(const std::string& nodelist);  // without expanding the whole list

}  // namespace moetrain::dist
