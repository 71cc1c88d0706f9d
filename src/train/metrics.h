// defines: the training metrics of each step, the console progress line and the JSONL log (one
// JSON object per step, appended and flushed, so a crash loses at most the step in flight).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace moetrain::train {

struct StepMetrics {
  int64_t step = 0;  // 1-based: steps completed
  int64_t total_steps = 0;
  double loss = 0.0;
  double lb_loss = 0.0;
  double z_loss = 0.0;
  // DeepSeek-V2's device-level balance loss (1.0 = balanced over the expert groups); reported only when on.
  bool has_device_balance = false;
  double device_balance = 0.0;
  double grad_norm = 0.0;
  double lr = 0.0;
  int64_t tokens = 0;  // tokens of this step over all ranks
  double step_seconds = 0.0;
  double tokens_per_s = 0.0;
  double tflops = 0.0;  // model TFLOP/s per device (0 when unknown)
  double mfu = 0.0;     // fraction of the device peak (0 when the peak is unknown)
  int64_t peak_mem_bytes = 0;
  double elapsed_s = 0.0;  // since the start of this run
  double eta_s = 0.0;
};

std::string format_progress_line(const StepMetrics& m);
std::string format_jsonl_record(const StepMetrics& m);

class MetricsLog {
 public:
  // `jsonl_path` empty: no file. Appends to an existing file (a resumed run continues its log).
  MetricsLog(const std::string& jsonl_path, int64_t console_every);
  void record(const StepMetrics& m);

 private:
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> jsonl_;
  int64_t console_every_;
};

}  // namespace moetrain::train
