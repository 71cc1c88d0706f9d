// defines: the memory fit check of a training job (memory_fit.h).
#include "train/memory_fit.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/cuda/runtime.h"

namespace moetrain::train {

namespace {

// MemAvailable of /proc/meminfo in bytes (what the kernel can hand out without swapping), or 0 when not readable.
int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:" && kib > 0 && kib < (int64_t{1} << 52)) return kib * 1024;
  }
  return 0;
}

int64_t host_physical_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * static_cast<int64_t>(page_size);
}

}  // namespace

void check_plan_fits(const MemoryPlan& plan, const MemoryBudget& budget) {
  MT_CHECK(!plan.ranks.empty(), "memory fit: the plan of mesh {} has no ranks", plan.mesh);
  const auto largest = std::max_element(plan.ranks.begin(), plan.ranks.end(),
                                        [](const RankMemory& a, const RankMemory& b) { return a.peak() < b.peak(); });
  int64_t need = largest->peak();
  if (budget.shared_by_ranks) {
    need = 0;
    for (const RankMemory& r : plan.ranks) need += r.peak() * r.ranks;
  }
  if (budget.available_bytes <= 0 || need <= budget.available_bytes) return;
  const RankMemory& r = *largest;
  MT_FAIL(
      "memory fit: the job needs {} at its peak ({}{}), but {} has {} available. The largest rank ({}): compute "
      "weights {}, fp32 masters {}, AdamW moments {}, gradients {}, activations {} ({} per micro-batch x {:.1f} "
      "alive), workspace {}{}. Lower train.micro_batch or train.seq_len, shard the parameters "
      "(parallel.sharding = full), add ranks, or pick a smaller model; `moetrain plan` prints the whole estimate",
      format_size(need), budget.shared_by_ranks ? "every rank together, on one host" : "its largest rank",
      plan.ranks.size() > 1 || r.ranks > 1 ? fmt::format(", mesh {}", plan.mesh) : std::string(), budget.where,
      format_size(budget.available_bytes), r.label, format_size(r.weights), format_size(r.masters),
      format_size(r.optimizer), format_size(r.gradients), format_size(r.activations),
      format_size(r.activations_per_micro_batch), r.micro_batches_alive, format_size(r.workspace),
      r.note.empty() ? std::string() : fmt::format(" ({})", r.note));
}

MemoryBudget memory_budget(const io::JobConfig& config) {
  const Device device = parse_device(config.model.device);
  MemoryBudget budget;
  if (device.is_cuda()) {
    ops::cuda::setup_cuda(device.index);
    const ops::cuda::DeviceMemory memory = ops::cuda::device_memory();
    budget.where = fmt::format("{} ({} total)", device.str(), format_size(memory.total_bytes));
    budget.available_bytes = memory.free_bytes;
    return budget;
  }
  budget.shared_by_ranks = true;
  budget.available_bytes = host_available_bytes();
  budget.where = "the host (MemAvailable)";
  if (budget.available_bytes == 0) {
    budget.available_bytes = host_physical_bytes();
    budget.where = "the host (physical memory)";
  }
  return budget;
}

void check_job_fits_memory(const io::JobConfig& config, int world) {
  const MemoryPlan plan = plan_memory(config, world);
  const MemoryBudget budget = memory_budget(config);
  check_plan_fits(plan, budget);
  const int64_t peak =
      std::max_element(plan.ranks.begin(), plan.ranks.end(), [](const RankMemory& a, const RankMemory& b) {
        return a.peak() < b.peak();
      })->peak();
  log_info("memory: planned peak {} per rank, {} available on {}", format_size(peak),
           format_size(budget.available_bytes), budget.where);
}

}  // namespace moetrain::train
