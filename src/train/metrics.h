// defines: the training metrics of each step, the console progress line, the JSONL log (one JSON object per step,
// appended and flushed, so a crash loses at most the step in flight) and the TensorBoard scalars of a step
// (train/tensorboard.h).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "train/tensorboard.h"

namespace moetrain::train {

// The process's resident memory (VmRSS of /proc/self/status) in bytes; 0 where it cannot be read. A long run's host
// memory shows in it (scripts/rss_check.sh reads it from the metrics file). Linux keeps the count in per-CPU parts
// that it folds in batches, so VmRSS can trail the truth by a few MiB for each CPU the process has run on.
int64_t host_resident_bytes();

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
  int64_t host_rss_bytes = 0;  // the process's resident memory after the step (VmRSS; 0 where unknown)
  double elapsed_s = 0.0;      // since the start of this run
  double eta_s = 0.0;
  // The load-balance value of each MoE layer, in layer order (same meaning as lb_loss: 1.0 = balanced),
  // token-weighted over the step's micro-batches and data ranks; empty for dense models.
  std::vector<double> layer_load_balance;
  // An evaluation ran after this step ([eval]): the token-weighted held-out cross-entropy over eval_tokens targets.
  bool has_eval = false;
  double eval_loss = 0.0;
  int64_t eval_tokens = 0;
  double eval_seconds = 0.0;
};

std::string format_progress_line(const StepMetrics& m);
// The console line of an evaluation: "eval loss X over N tokens (S s)".
std::string format_eval_line(const StepMetrics& m);
// JSON keys: step, loss, lb_loss, z_loss, device_balance (when on), grad_norm, lr, tokens, tokens_per_s, tflops, mfu,
// peak_mem_bytes, step_s, elapsed_s, layer_load_balance (MoE models), eval_loss and eval_tokens (steps with an
// evaluation). `moetrain report` reads these names: keep them stable.
std::string format_jsonl_record(const StepMetrics& m);
// The TensorBoard scalars of a step: train/loss, train/lb_loss, train/z_loss, train/device_balance (when on),
// train/lr, train/grad_norm, perf/tokens_per_s, perf/tflops, perf/mfu, mem/peak_gib, balance/layer_NN (NN: the MoE
// layer's place in layer_load_balance, two digits or more), and eval/loss with eval/tokens after an evaluation.
Scalars tensorboard_scalars(const StepMetrics& m);

class MetricsLog {
 public:
  // `jsonl_path` empty: no file. Appends to an existing file (a resumed run continues its log).
  // `tensorboard_dir` empty: no event file; else a new event file in that folder (created).
  MetricsLog(const std::string& jsonl_path, int64_t console_every, const std::string& tensorboard_dir = "");
  void record(const StepMetrics& m);

 private:
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> jsonl_;
  int64_t console_every_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace moetrain::train
