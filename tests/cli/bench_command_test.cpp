// Tests for `moetrain bench`: a CPU run of the tiny example on synthetic tokens writes every figure
// it prints (tokens/s, memory by role, time by op family), and bad step counts fail before any work.
#include "cli/bench_command.h"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "testing/test_data.h"

namespace moetrain::cli {
namespace {

BenchOptions tiny_bench(const std::string& out) {
  BenchOptions o;
  o.config = std::string(MOETRAIN_TEST_DATA_DIR) + "/../../examples/tiny_moe/job.toml";
  o.warmup = 1;
  o.steps = 2;
  o.out = out;
  o.overrides = {"data.mode=synthetic",  "data.path=",     "train.seq_len=16",          "train.micro_batch=2",
                 "train.global_batch=4", "metrics.jsonl=", "metrics.console_every=1000"};
  return o;
}

TEST(BenchCommand, WritesThroughputMemoryAndTimeByOpFamily) {
  const std::string out = testing::make_temp_dir("bench_command") + "/bench.json";
  ASSERT_EQ(run_bench(tiny_bench(out)), 0);
  std::ifstream in(out);
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json r = nlohmann::json::parse(in);
  EXPECT_EQ(r.at("timed_steps").get<int64_t>(), 2);
  EXPECT_EQ(r.at("tokens_per_step").get<double>(), 64.0);  // 2 micro-batches of 2 x 16 tokens
  EXPECT_GT(r.at("tokens_per_s").get<double>(), 0.0);
  const nlohmann::json& memory = r.at("memory");
  // f32 on the CPU: no compute copies; AdamW holds twice the masters.
  EXPECT_EQ(memory.at("compute_weights_GiB").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(memory.at("optimizer_state_GiB").get<double>(), 2.0 * memory.at("masters_GiB").get<double>());
  EXPECT_DOUBLE_EQ(memory.at("gradients_GiB").get<double>(), memory.at("masters_GiB").get<double>());
  const nlohmann::json& time = r.at("time_per_step_s");
  for (const char* family : {"gemm", "attention", "grouped_gemm", "norm", "loss", "optimizer", "other"})
    EXPECT_TRUE(time.contains(family)) << "no time for " << family << " in " << time.dump();
}

TEST(BenchCommand, RejectsStepCountsBeforeAnyWork) {
  BenchOptions o = tiny_bench("");
  o.steps = 0;
  EXPECT_THROW(run_bench(o), Error);
  o.steps = 2;
  o.warmup = -1;
  EXPECT_THROW(run_bench(o), Error);
}

}  // namespace
}  // namespace moetrain::cli
