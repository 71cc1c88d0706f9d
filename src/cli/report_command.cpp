// defines: the report command: reads the metrics and the configuration files, renders the page, writes it.
#include "cli/report_command.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/error.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "train/report_html.h"

namespace moetrain::cli {

namespace {

std::string read_text(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good() && !std::filesystem::is_directory(path), "report: cannot read the {} '{}'", what, path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  return std::filesystem::exists(a) && std::filesystem::exists(b) && std::filesystem::equivalent(a, b, error);
}

// The job file and, when the job names a readable model config.json, that file too.
std::vector<train::ReportFile> config_files(const std::string& job_path) {
  std::vector<train::ReportFile> files;
  if (job_path.empty()) return files;
  files.push_back({job_path, read_text(job_path, "job file")});
  // Only [model] config is read (relative to the job file, as the job's paths are): a job file that no longer
  // validates in full (an older run's) still gets its model's config.json embedded.
  std::string model_path;
  try {
    const toml::table job = toml::parse_file(job_path);
    if (const auto value = job["model"]["config"].value<std::string>()) model_path = *value;
  } catch (const toml::parse_error& e) {
    log_warn("report: the job file '{}' is not valid TOML ({}); only its text is embedded", job_path,
             std::string(e.description()));
    return files;
  }
  if (model_path.empty()) return files;
  std::filesystem::path model(model_path);
  if (model.is_relative()) model = std::filesystem::path(job_path).parent_path() / model;
  if (std::filesystem::is_directory(model)) model /= "config.json";
  if (std::filesystem::is_regular_file(model)) {
    files.push_back({model.lexically_normal().string(), read_text(model.string(), "model config")});
  } else {
    log_warn("report: the job's model.config '{}' is not a readable file; only the job file is embedded",
             model.string());
  }
  return files;
}

}  // namespace

int run_report(const ReportOptions& options) {
  MT_CHECK(!options.out.empty(), "report: --out names no file");
  MT_CHECK(
      !same_file(options.out, options.metrics) && (options.config.empty() || !same_file(options.out, options.config)),
      "report: --out '{}' is one of the inputs; name a new .html file", options.out);
  MT_CHECK(!std::filesystem::is_directory(options.out), "report: --out '{}' is a folder; name an .html file",
           options.out);
  const train::MetricsRun run = train::read_metrics_jsonl(options.metrics);
  for (const std::string& warning : run.warnings) log_warn("report: {}", warning);
  train::ReportInputs inputs;
  inputs.title = std::filesystem::path(options.metrics).filename().string();
  inputs.configs = config_files(options.config);
  const std::string html = train::render_report_html(run, inputs);
  io::write_file_atomically(options.out, {{html.data(), html.size()}}, "report");
  fmt::print("report: {} records (steps {} to {}) -> {} ({} bytes)\n", run.records.size(), run.records.front().step,
             run.records.back().step, options.out, html.size());
  std::fflush(stdout);
  return 0;
}

void add_report_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* report = app.add_subcommand("report", "Write one self-contained HTML page of a run's metrics JSONL");
  auto options = std::make_shared<ReportOptions>();  // kept alive by the callback below
  report->add_option("--metrics", options->metrics, "the run's metrics JSONL")->required();
  report->add_option("--out", options->out, "the HTML page to write")->required();
  report->add_option("--config", options->config, "the job TOML (embedded, with the model's config.json)");
  report->callback([options, &command] { command = [options] { return run_report(*options); }; });
}

}  // namespace moetrain::cli
