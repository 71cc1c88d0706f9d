// defines: the memory fit check of a training job, the first use of `moetrain plan`'s estimate (issue 20): before
// anything is allocated, the planned peak (train/memory_plan.h) is compared with the memory the ranks will run in (the
// GPU's free memory for a CUDA rank; the host's available memory, shared by every thread rank, on the CPU), and a job
// that cannot fit is refused in milliseconds, naming the sizes, instead of allocating for a minute and then failing.
#pragma once

#include <cstdint>
#include <string>

#include "io/job_config.h"
#include "train/memory_plan.h"

namespace moetrain::train {

// The memory a job's ranks run in.
struct MemoryBudget {
  std::string where;  // "cuda:0 (free of 139.7 GiB)", "the host (MemAvailable)"
  int64_t available_bytes = 0;
  bool shared_by_ranks = false;  // thread ranks on the CPU share one host: their peaks add up
};

// Refuses `plan` when its peak does not fit `budget`: the largest rank's peak against a device of its own, or every
// rank's peak together against a shared host. The error names the need, the budget and the parts of the largest rank
// (parameters, optimizer, gradients, activations, workspace) and what to change.
void check_plan_fits(const MemoryPlan& plan, const MemoryBudget& budget);

// The budget of `config`'s ranks on this machine: cudaMemGetInfo's free bytes of model.device (set up here), or the
// host's MemAvailable (/proc/meminfo; the physical memory where that is not readable) for model.device = cpu.
MemoryBudget memory_budget(const io::JobConfig& config);

// plan_memory(config, world), then check_plan_fits against memory_budget(config).
void check_job_fits_memory(const io::JobConfig& config, int world);

}  // namespace moetrain::train
