// defines: `moetrain report --metrics run.jsonl --out run.html [--config job.toml]`: one self-contained HTML page of a
// training run (train/report_html.h), with the job file and the model's config.json embedded when given.
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

namespace moetrain::cli {

struct ReportOptions {
  std::string metrics;  // the run's metrics JSONL (metrics.jsonl of the job)
  std::string out;      // the HTML page to write (atomically)
  std::string config;   // the job TOML; empty: no configuration section
};

int run_report(const ReportOptions& options);

void add_report_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
