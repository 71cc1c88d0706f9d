// Tests for train/metrics: the console line and the JSONL record report DeepSeek-V2's device-level balance only
// when it is on, and keep every other key as it was; the process's resident memory is measured and recorded.
#include "train/metrics.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace moetrain::train {
namespace {

StepMetrics some_step() {
  StepMetrics m;
  m.step = 3;
  m.total_steps = 10;
  m.loss = 2.5;
  m.lb_loss = 1.125;
  m.z_loss = 4.0;
  m.grad_norm = 0.75;
  m.lr = 1e-3;
  m.tokens = 64;
  m.tokens_per_s = 1000.0;
  return m;
}

TEST(Metrics, DeviceBalanceIsReportedOnlyWhenOn) {
  StepMetrics off = some_step();
  off.device_balance = 1.5;  // ignored: the loss is off
  const nlohmann::json record_off = nlohmann::json::parse(format_jsonl_record(off));
  EXPECT_FALSE(record_off.contains("device_balance")) << record_off.dump();
  EXPECT_EQ(format_progress_line(off).find("devbal"), std::string::npos) << format_progress_line(off);

  StepMetrics on = off;
  on.has_device_balance = true;
  const nlohmann::json record_on = nlohmann::json::parse(format_jsonl_record(on));
  ASSERT_TRUE(record_on.contains("device_balance")) << record_on.dump();
  EXPECT_EQ(record_on["device_balance"].get<double>(), 1.5);
  EXPECT_NE(format_progress_line(on).find("| lb 1.125 | devbal 1.500 | lr "), std::string::npos)
      << format_progress_line(on);

  // Every other key is the same with and without it.
  nlohmann::json rest = record_on;
  rest.erase("device_balance");
  EXPECT_EQ(rest, record_off);
  for (const char* key : {"step", "loss", "lb_loss", "z_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops",
                          "mfu", "peak_mem_bytes", "step_s", "elapsed_s"}) {
    EXPECT_TRUE(record_off.contains(key)) << key;
  }
}

// The process's resident memory: read from /proc/self/status, grown by touching 256 MiB, recorded when known. The
// kernel's count trails by what each CPU has not folded in yet (a few MiB a CPU the thread ran on while touching:
// 60 of 64 MiB failed once), so the touch is large and the margin 32 MiB.
TEST(Metrics, HostResidentMemoryIsMeasuredAndRecorded) {
  const int64_t before = host_resident_bytes();
  ASSERT_GT(before, int64_t{1} << 20) << "VmRSS of this test process";
  std::vector<char> touched(size_t{256} << 20, 1);
  const int64_t after = host_resident_bytes();
  EXPECT_GE(after - before, int64_t{224} << 20) << "256 MiB touched: " << before << " -> " << after;
  EXPECT_EQ(touched[touched.size() / 2], 1);

  StepMetrics m = some_step();
  EXPECT_FALSE(nlohmann::json::parse(format_jsonl_record(m)).contains("host_rss_bytes"));  // unknown: left out
  m.host_rss_bytes = after;
  EXPECT_EQ(nlohmann::json::parse(format_jsonl_record(m))["host_rss_bytes"].get<int64_t>(), after);
}

}  // namespace
}  // namespace moetrain::train
