// Tests for `moetrain bench`: a CPU run of the tiny example on synthetic tokens writes every figure
// it prints (tokens/s, memory by role, time by op family and by op from profiled steps, none without them), the
// materialised head's loss in one pass pair, and bad step counts fail before any work; the timed steps' energy only where the GPU's counter advanced, and on a GPU
// that energy.
#include "cli/bench_command.h"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::cli {
namespace {

BenchOptions tiny_bench(const std::string& out) {
  BenchOptions o;
  o.config = testing::repo_path("examples/tiny_moe/job.toml");
  o.warmup = 1;
  o.steps = 2;
  o.out = out;
  o.overrides = {"data.mode=synthetic",  "data.path=",     "train.seq_len=16",          "train.micro_batch=2",
                 "train.global_batch=4", "metrics.jsonl=", "metrics.console_every=1000"};
  return o;
}

TEST(BenchCommand, WritesThroughputMemoryAndTimeByOpFamilyAndOp) {
  const std::string out = testing::make_temp_dir("bench_command") + "/bench.json";
  ASSERT_EQ(run_bench(tiny_bench(out)), 0);
  std::ifstream in(out);
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json r = nlohmann::json::parse(in);
  EXPECT_EQ(r.at("timed_steps").get<int64_t>(), 2);
  EXPECT_EQ(r.at("tokens_per_step").get<double>(), 64.0);  // 2 micro-batches of 2 x 16 tokens
  EXPECT_GT(r.at("tokens_per_s").get<double>(), 0.0);
  EXPECT_FALSE(r.contains("energy")) << "a CPU run has no GPU energy to report";
  const nlohmann::json& memory = r.at("memory");
  // f32 on the CPU: no compute copies; AdamW holds twice the masters.
  EXPECT_EQ(memory.at("compute_weights_GiB").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(memory.at("optimizer_state_GiB").get<double>(), 2.0 * memory.at("masters_GiB").get<double>());
  EXPECT_DOUBLE_EQ(memory.at("gradients_GiB").get<double>(), memory.at("masters_GiB").get<double>());
  // The time by op comes from as many profiled steps after the timed ones, with their own wall time.
  EXPECT_EQ(r.at("profiled_steps").get<int64_t>(), 2);
  EXPECT_GT(r.at("profiled_step_s").get<double>(), 0.0);
  const nlohmann::json& time = r.at("time_per_step_s");
  for (const char* family : {"gemm", "attention", "grouped_gemm", "norm", "loss", "optimizer", "other"})
    EXPECT_TRUE(time.contains(family)) << "no time for " << family << " in " << time.dump();
  // Each family's time split by op: the ops add up to their family, and the ops of a step are named.
  const nlohmann::json& by_op = r.at("time_per_op_s");
  for (const auto& [family, ops_of_family] : by_op.items()) {
    double sum = 0.0;
    for (const auto& [op, seconds] : ops_of_family.items()) sum += seconds.get<double>();
    EXPECT_NEAR(sum, time.at(family).get<double>(), 1e-9 + 1e-9 * sum) << family;
  }
  for (const auto& [family, op] :
       std::vector<std::pair<std::string, std::string>>{{"gemm", "linear_forward"},
                                                        {"gemm", "linear_backward_weight"},
                                                        {"grouped_gemm", "grouped_linear_backward_weight"},
                                                        {"loss", "linear_cross_entropy_forward_backward"},
                                                        {"optimizer", "adamw_step_multi"}}) {
    EXPECT_TRUE(by_op.contains(family) && by_op.at(family).contains(op))
        << "no time for " << family << " / " << op << " in " << by_op.dump();
  }
}

// --profile-steps 0 runs the timed steps alone: throughput and memory, no time by op.
TEST(BenchCommand, NoProfiledStepsGivesNoTimeByOp) {
  const std::string out = testing::make_temp_dir("bench_command_unprofiled") + "/bench.json";
  BenchOptions o = tiny_bench(out);
  o.profile_steps = 0;
  ASSERT_EQ(run_bench(o), 0);
  std::ifstream in(out);
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json r = nlohmann::json::parse(in);
  EXPECT_EQ(r.at("timed_steps").get<int64_t>(), 2);
  EXPECT_EQ(r.at("profiled_steps").get<int64_t>(), 0);
  EXPECT_GT(r.at("tokens_per_s").get<double>(), 0.0);
  EXPECT_TRUE(r.contains("memory"));
  EXPECT_FALSE(r.contains("time_per_step_s")) << r.dump();
  EXPECT_FALSE(r.contains("time_per_op_s")) << r.dump();
}

TEST(BenchCommand, MaterialisedHeadMakesTheLossGradientInTheLossPass) {
  const std::string out = testing::make_temp_dir("bench_command_materialised") + "/bench.json";
  BenchOptions o = tiny_bench(out);
  o.overrides.push_back("model.head_chunk=0");
  ASSERT_EQ(run_bench(o), 0);
  std::ifstream in(out);
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json loss = nlohmann::json::parse(in).at("time_per_op_s").at("loss");
  EXPECT_TRUE(loss.contains("cross_entropy_forward_backward")) << loss.dump();
  EXPECT_FALSE(loss.contains("cross_entropy_backward"))
      << "a training step's logits need one pass pair: " << loss.dump();
}

// On a GPU the timed steps' energy comes from the driver's counter: some joules a step, a mean power within the
// device's range, the limit it is held to and a running SM clock. The tiny model's steps take ~14 ms on an H100, and
// four of them once fell inside one update of the counter: 40 steps give it half a second.
TEST(CudaBenchCommand, ReportsTheGpuEnergyOfTheTimedSteps) {
  MT_REQUIRE_GPU();
  const std::string out = testing::make_temp_dir("bench_command_cuda") + "/bench.json";
  BenchOptions o = tiny_bench(out);
  o.steps = 40;
  o.overrides.push_back("model.device=cuda");
  o.overrides.push_back("model.compute_dtype=bf16");
  ASSERT_EQ(run_bench(o), 0);
  std::ifstream in(out);
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json r = nlohmann::json::parse(in);
  ASSERT_TRUE(r.contains("energy")) << r.value("energy_not_measured", "NVML read nothing on a machine with a GPU");
  const nlohmann::json& e = r.at("energy");
  const double limit = e.at("power_limit_W").get<double>();
  EXPECT_GT(limit, 50.0);
  EXPECT_GT(e.at("joules_per_step").get<double>(), 0.0);
  EXPECT_GT(e.at("window_s").get<double>(), 0.0);
  EXPECT_GT(e.at("mean_power_W").get<double>(), 10.0);
  // The limit holds as an average: a short window's mean may pass it, but not by far.
  EXPECT_LT(e.at("mean_power_W").get<double>(), 1.5 * limit);
  EXPECT_GT(e.at("sm_clock_MHz_at_end").get<int>(), 0);
}

// The driver's energy counter moves in steps: a window it did not advance over measured nothing, and the bench must
// not report that as zero joules. One that did gives joules a step and the mean power over the wall time.
TEST(BenchCommand, EnergyOfTimedStepsNeedsTheCounterToAdvance) {
  ops::cuda::GpuPowerReading before{.energy_joules = 5000.0, .power_limit_watts = 700.0, .sm_clock_mhz = 1980};
  ops::cuda::GpuPowerReading after = before;
  after.sm_clock_mhz = 1590;
  EXPECT_FALSE(energy_of_timed_steps(before, after, 0.055, 4).has_value()) << "a counter that did not move";
  after.energy_joules = 4999.0;
  EXPECT_FALSE(energy_of_timed_steps(before, after, 0.055, 4).has_value()) << "a counter that went back";
  after.energy_joules = 5000.0 + 1400.0;
  const std::optional<nlohmann::json> energy = energy_of_timed_steps(before, after, 2.0, 4);
  ASSERT_TRUE(energy.has_value());
  EXPECT_DOUBLE_EQ(energy->at("joules_per_step").get<double>(), 350.0);
  EXPECT_DOUBLE_EQ(energy->at("mean_power_W").get<double>(), 700.0);
  EXPECT_DOUBLE_EQ(energy->at("window_s").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(energy->at("power_limit_W").get<double>(), 700.0);
  EXPECT_EQ(energy->at("sm_clock_MHz_at_end").get<int>(), 1590);
}

TEST(BenchCommand, RejectsStepCountsBeforeAnyWork) {
  BenchOptions o = tiny_bench("");
  o.steps = 0;
  EXPECT_THROW(run_bench(o), Error);
  o.steps = 2;
  o.warmup = -1;
  EXPECT_THROW(run_bench(o), Error);
  o.warmup = 1;
  o.profile_steps = -2;
  EXPECT_THROW(run_bench(o), Error);
}

}  // namespace
}  // namespace moetrain::cli
