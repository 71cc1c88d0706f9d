// defines: metrics formatting and the console/JSONL sinks.
#include "train/metrics.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"

namespace moetrain::train {

namespace {

std::string human_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

}  // namespace

int64_t host_resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("VmRSS:")) continue;
    std::istringstream fields(line.substr(6));
    int64_t kib = 0;
    return fields >> kib && kib > 0 && kib < (int64_t{1} << 52) ? kib * 1024 : 0;
  }
  return 0;
}

std::string format_progress_line(const StepMetrics& m) {
  std::string line = fmt::format("step {}/{} | loss {:.4f} | lb {:.3f}", m.step, m.total_steps, m.loss, m.lb_loss);
  if (m.has_device_balance) line += fmt::format(" | devbal {:.3f}", m.device_balance);
  line += fmt::format(" | lr {:.3e} | gnorm {:.3f} | {:.0f} tok/s", m.lr, m.grad_norm, m.tokens_per_s);
  if (m.mfu > 0.0) line += fmt::format(" | {:.1f} TFLOP/s | MFU {:.1f}%", m.tflops, 100.0 * m.mfu);
  line += fmt::format(" | mem {:.1f} MiB | eta {}", static_cast<double>(m.peak_mem_bytes) / (1 << 20),
                      human_duration(m.eta_s));
  return line;
}

std::string format_eval_line(const StepMetrics& m) {
  return fmt::format("step {}/{} | eval loss {:.4f} over {} tokens ({:.1f}s)", m.step, m.total_steps, m.eval_loss,
                     m.eval_tokens, m.eval_seconds);
}

std::string format_jsonl_record(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lb_loss"] = m.lb_loss;
  j["z_loss"] = m.z_loss;
  if (m.has_device_balance) j["device_balance"] = m.device_balance;
  j["grad_norm"] = m.grad_norm;
  j["lr"] = m.lr;
  j["tokens"] = m.tokens;
  j["tokens_per_s"] = m.tokens_per_s;
  j["tflops"] = m.tflops;
  j["mfu"] = m.mfu;
  j["peak_mem_bytes"] = m.peak_mem_bytes;
  if (m.host_rss_bytes > 0) j["host_rss_bytes"] = m.host_rss_bytes;
  j["step_s"] = m.step_seconds;
  j["elapsed_s"] = m.elapsed_s;
  if (!m.layer_load_balance.empty()) j["layer_load_balance"] = m.layer_load_balance;
  if (m.has_eval) {
    j["eval_loss"] = m.eval_loss;
    j["eval_tokens"] = m.eval_tokens;
  }
  return j.dump();
}

Scalars tensorboard_scalars(const StepMetrics& m) {
  Scalars s = {{"train/loss", m.loss}, {"train/lb_loss", m.lb_loss}, {"train/z_loss", m.z_loss}};
  if (m.has_device_balance) s.emplace_back("train/device_balance", m.device_balance);
  s.insert(s.end(), {{"train/lr", m.lr},
                     {"train/grad_norm", m.grad_norm},
                     {"perf/tokens_per_s", m.tokens_per_s},
                     {"perf/tflops", m.tflops},
                     {"perf/mfu", m.mfu},
                     {"mem/peak_gib", static_cast<double>(m.peak_mem_bytes) / double(int64_t{1} << 30)}});
  for (size_t i = 0; i < m.layer_load_balance.size(); ++i) {
    s.emplace_back(fmt::format("balance/layer_{:02}", i), m.layer_load_balance[i]);
  }
  if (m.has_eval) {
    s.emplace_back("eval/loss", m.eval_loss);
    s.emplace_back("eval/tokens", static_cast<double>(m.eval_tokens));
  }
  return s;
}

MetricsLog::MetricsLog(const std::string& jsonl_path, int64_t console_every, const std::string& tensorboard_dir)
    : jsonl_(nullptr, &std::fclose), console_every_(console_every) {
  if (!tensorboard_dir.empty()) tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir);
  if (jsonl_path.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(jsonl_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  jsonl_.reset(std::fopen(jsonl_path.c_str(), "a"));
  MT_CHECK(jsonl_ != nullptr, "metrics.jsonl: cannot open '{}' for appending: {}", jsonl_path, std::strerror(errno));
}

void MetricsLog::record(const StepMetrics& m) {
  if (console_every_ > 0 && (m.step % console_every_ == 0 || m.step == m.total_steps))
    log_info("{}", format_progress_line(m));
  if (console_every_ > 0 && m.has_eval) log_info("{}", format_eval_line(m));
  if (jsonl_) {
    const std::string line = format_jsonl_record(m) + "\n";
    MT_CHECK(std::fwrite(line.data(), 1, line.size(), jsonl_.get()) == line.size() && std::fflush(jsonl_.get()) == 0,
             "metrics.jsonl: write failed: {}", std::strerror(errno));
  }
  if (tensorboard_) tensorboard_->add_scalars(m.step, tensorboard_scalars(m));
}

}  // namespace moetrain::train
