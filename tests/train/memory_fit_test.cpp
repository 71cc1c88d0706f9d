// Tests for train/memory_fit.h (issue 20, "Huge sizes are not refused up front"): a job whose planned peak does not
// fit the memory it runs in is refused before anything is allocated, within a second, naming the sizes; a job that
// fits runs; thread ranks on one host are counted together; on a GPU the device's free memory is the budget.
#include "train/memory_fit.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/allocator.h"
#include "core/error.h"
#include "io/job_config.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"
#include "testing/tiny_moe_job.h"
#include "train/launch.h"
#include "train/memory_plan.h"

namespace moetrain::train {
namespace {

io::JobConfig tiny_job(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"train.steps=1", "train.seq_len=64", "train.micro_batch=2"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return testing::tiny_moe_job(all);
}

int64_t largest_peak(const MemoryPlan& plan) {
  int64_t peak = 0;
  for (const RankMemory& r : plan.ranks) peak = std::max(peak, r.peak());
  return peak;
}

std::string refusal(const MemoryPlan& plan, const MemoryBudget& budget) {
  try {
    check_plan_fits(plan, budget);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MemoryFit, APlanWithinTheBudgetPassesAndOneByteShortIsRefusedNamingTheSizes) {
  const MemoryPlan plan = plan_memory(tiny_job({}), 1);
  const int64_t peak = largest_peak(plan);
  ASSERT_GT(peak, 0);
  EXPECT_NO_THROW(check_plan_fits(plan, MemoryBudget{"cuda:0 (test)", peak, false}));
  const std::string error = refusal(plan, MemoryBudget{"cuda:0 (test)", peak - 1, false});
  ASSERT_FALSE(error.empty()) << "a peak of " << peak << " bytes fitted " << peak - 1;
  for (const std::string word : {"memory fit", "cuda:0 (test)", "fp32 masters", "AdamW moments", "gradients",
                                 "activations", "workspace", "train.micro_batch", "moetrain plan"}) {
    EXPECT_NE(error.find(word), std::string::npos) << word << " is missing from: " << error;
  }
}

TEST(MemoryFit, ThreadRanksOnOneHostAreCountedTogether) {
  const MemoryPlan plan = plan_memory(tiny_job({"dist.local_ranks=2", "train.global_batch=4"}), 2);
  int64_t together = 0;
  for (const RankMemory& r : plan.ranks) together += r.peak() * r.ranks;
  ASSERT_GT(together, largest_peak(plan));  // two ranks need more than one
  // A budget that holds one rank but not both: a GPU each is enough, one shared host is not.
  const int64_t one_rank = largest_peak(plan);
  EXPECT_NO_THROW(check_plan_fits(plan, MemoryBudget{"cuda:0", one_rank, false}));
  const std::string error = refusal(plan, MemoryBudget{"the host", together - 1, true});
  EXPECT_NE(error.find("every rank together"), std::string::npos) << error;
  EXPECT_NO_THROW(check_plan_fits(plan, MemoryBudget{"the host", together, true}));
}

TEST(MemoryFit, AnUnknownBudgetRefusesNothing) {
  const MemoryPlan plan = plan_memory(tiny_job({}), 1);
  EXPECT_NO_THROW(check_plan_fits(plan, MemoryBudget{"nowhere", 0, true}));
}

TEST(MemoryFit, TheHostBudgetIsMeasured) {
  const MemoryBudget budget = memory_budget(tiny_job({}));
  EXPECT_TRUE(budget.shared_by_ranks);
  EXPECT_GT(budget.available_bytes, int64_t{1} << 20) << budget.where;
  EXPECT_NE(budget.where.find("the host"), std::string::npos) << budget.where;
}

// Parameters that fit (the tiny model's 3.6 M) but activations that cannot: 2^28 tokens in one micro-batch need
// terabytes. The training job stops before its first allocation, in milliseconds, and says why.
TEST(MemoryFit, ATrainingJobWhoseActivationsCannotFitIsRefusedBeforeItAllocates) {
  const io::JobConfig config = tiny_job({"train.seq_len=4096", "train.micro_batch=65536"});
  const int64_t live_before = memory_stats(DeviceKind::CPU).live_bytes;
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    run_training_job(config);
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(error.empty()) << "a micro-batch of 2^28 tokens was trained";
  EXPECT_NE(error.find("memory fit"), std::string::npos) << error;
  EXPECT_NE(error.find("the host"), std::string::npos) << error;
  EXPECT_NE(error.find("GiB at its peak"), std::string::npos) << error;
  EXPECT_LT(seconds, 1.0);
  EXPECT_EQ(memory_stats(DeviceKind::CPU).live_bytes, live_before);
}

// Thread ranks on a GPU share its memory, so the launch skips the per-rank fit check there: on a machine without a
// GPU the CUDA backend's own error comes first, not a device query of the fit check.
TEST(MemoryFit, ThreadRanksOnAGpuSkipTheFitCheck) {
  if (ops::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible: the job would run";
  testing::expect_error(
      [] {
        run_training_job(tiny_job({"dist.local_ranks=2", "train.global_batch=4", "model.device=cuda"}));
      },
      "cuda:");
}

TEST(MemoryFit, ATrainingJobThatFitsRuns) {
  const TrainSummary summary = run_training_job(tiny_job({}));
  EXPECT_EQ(summary.losses.size(), 1u);
}

TEST(CudaMemoryFit, TheDeviceFreeMemoryIsTheBudgetAndAJobTooLargeForItIsRefused) {
  MT_REQUIRE_GPU();
  io::JobConfig config = tiny_job({"model.device=cuda", "model.compute_dtype=bf16"});
  const MemoryBudget budget = memory_budget(config);
  EXPECT_FALSE(budget.shared_by_ranks);
  EXPECT_GT(budget.available_bytes, int64_t{1} << 30) << budget.where;
  EXPECT_NE(budget.where.find("cuda:0"), std::string::npos) << budget.where;
  config = tiny_job({"model.device=cuda", "model.compute_dtype=bf16", "train.seq_len=4096", "train.micro_batch=65536"});
  const int64_t live_before = memory_stats(DeviceKind::CUDA).live_bytes;
  try {
    run_training_job(config);
    FAIL() << "a micro-batch of 2^28 tokens was trained on the GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory fit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(memory_stats(DeviceKind::CUDA).live_bytes, live_before);
}

}  // namespace
}  // namespace moetrain::train
