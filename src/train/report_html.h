// defines: the run report: the metrics JSONL of a training run read back (robust to a crash mid-write and to resumed
// runs) and rendered as one self-contained HTML page (inline CSS and SVG charts, no script, no network) that a person
// opens in a browser: loss and eval loss, learning rate, gradient norm, tokens/s and load balance against the step,
// a summary table and the run's configuration files.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moetrain::train {

// One step's record of the metrics JSONL (train/metrics.h writes it).
struct MetricsRecord {
  int64_t step = 0;
  std::map<std::string, double> scalars;   // every finite numeric field but "step" (null and NaN: absent)
  std::vector<double> layer_load_balance;  // one per MoE layer (1.0 = balanced); empty when absent
  bool has(const std::string& field) const { return scalars.count(field) != 0; }
};

struct MetricsRun {
  std::vector<MetricsRecord> records;  // ascending steps, one per step
  std::vector<std::string> warnings;   // what the reader skipped or replaced, one line each
};

// Parses the JSONL text. A last line without its newline that does not parse (a crash mid-write) is skipped with a
// warning; any other malformed line is an error naming "<source>:<line>"; no record at all is an error. When the
// steps go back (a run resumed from a checkpoint), the records from that step on are replaced by the later ones, so
// each step keeps its last record.
MetricsRun parse_metrics_jsonl(const std::string& text, const std::string& source);
MetricsRun read_metrics_jsonl(const std::string& path);

// At most `max_points` points: unchanged when they fit; else the x-ordered points cut into max_points / 2 buckets of
// consecutive points, each bucket giving its minimum and its maximum (in x order), so spikes survive. Deterministic.
std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points);
inline constexpr size_t kReportMaxPoints = 2000;

struct ReportFile {
  std::string name;  // shown as the block's title (a path)
  std::string text;  // shown verbatim, HTML-escaped
};

struct ReportInputs {
  std::string title;                // the page's heading (e.g. the metrics file's name)
  std::vector<ReportFile> configs;  // the job file, the model's config.json, ...
};

// The whole page. Text from the inputs is HTML-escaped; nothing refers to anything outside the page.
std::string render_report_html(const MetricsRun& run, const ReportInputs& inputs);

// `text` with & < > " ' escaped for HTML text and attribute values.
std::string html_escape(const std::string& text);

}  // namespace moetrain::train
