// defines: the metrics JSONL reader and the HTML report's rendering (inline SVG charts drawn here).
#include "train/report_html.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain::train {

namespace {

MetricsRecord record_from_json(const nlohmann::json& j, const std::string& where) {
  MT_CHECK(j.is_object(), "{}: expected a JSON object per line but found {}", where, j.type_name());
  MT_CHECK(j.contains("step") && j.at("step").is_number_integer(),
           "{}: expected an integer field 'step' in every record but found {}", where,
           j.contains("step") ? j.at("step").dump() : std::string("none"));
  MetricsRecord r;
  r.step = j.at("step").get<int64_t>();
  for (const auto& [key, value] : j.items()) {
    if (key == "step") continue;
    if (key == "layer_load_balance") {
      if (value.is_null()) continue;
      MT_CHECK(value.is_array(), "{}: expected 'layer_load_balance' to be an array of numbers but found {}", where,
               value.type_name());
      for (const nlohmann::json& v : value) {
        MT_CHECK(v.is_number() || v.is_null(),
                 "{}: expected 'layer_load_balance' to hold numbers (one per MoE layer) but found {}", where, v.dump());
        r.layer_load_balance.push_back(v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>());
      }
      continue;
    }
    if (!value.is_number()) continue;  // strings, objects and nulls carry nothing to chart
    const double x = value.get<double>();
    if (std::isfinite(x)) r.scalars[key] = x;
  }
  return r;
}

std::string fmt_number(double v) {
  if (v == 0.0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.2e}", v);
  return fmt::format("{:.4g}", v);
}

std::string fmt_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
}

std::string fmt_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m{:02}s", s / 3600, (s % 3600) / 60, s % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{:.1f}s", seconds);
}

// About `count` round tick values (1, 2 or 5 times a power of ten) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int count) {
  const double range = hi - lo;
  const double raw = range / std::max(count, 1);
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = power;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * power;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  }
  return ticks;
}

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (step, value)
  bool markers = false;                           // points drawn as dots (eval loss), not a line
};

constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79", "#637939"};

// One chart: axes with ticks and labels, a polyline per line series, dots for marker series, a legend.
std::string render_chart(const std::string& id, const std::string& title, const std::string& y_label,
                         const std::vector<Series>& series) {
  constexpr double kWidth = 680, kHeight = 300, kLeft = 78, kRight = 26, kTop = 34, kBottom = 46;
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo, y_lo = x_lo, y_hi = -x_lo;
  size_t total = 0;
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x), y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
      ++total;
    }
  }
  std::string svg = fmt::format(
      "<figure class=\"chart\" id=\"chart-{}\">\n<figcaption>{}</figcaption>\n"
      "<svg viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" role=\"img\" "
      "aria-label=\"{}\">\n<title>{}</title>\n",
      id, html_escape(title), kWidth, kHeight, kWidth, kHeight, html_escape(title), html_escape(title));
  svg += fmt::format("<rect class=\"plot\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>\n", kLeft, kTop, pw, ph);
  if (total == 0) {
    svg += fmt::format("<text class=\"empty\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">no data in this run</text>\n",
                       kLeft + pw / 2, kTop + ph / 2);
    return svg + "</svg>\n</figure>\n";
  }
  if (x_hi == x_lo) x_lo -= 1, x_hi += 1;
  if (y_hi == y_lo) {
    const double pad = y_lo == 0.0 ? 1.0 : std::fabs(y_lo) * 0.05;
    y_lo -= pad, y_hi += pad;
  } else {
    const double pad = (y_hi - y_lo) * 0.05;
    y_lo -= pad, y_hi += pad;
  }
  const auto px = [&](double x) { return kLeft + (x - x_lo) / (x_hi - x_lo) * pw; };
  const auto py = [&](double y) { return kTop + ph - (y - y_lo) / (y_hi - y_lo) * ph; };

  svg += "<g class=\"axis\">\n";
  for (const double t : nice_ticks(y_lo, y_hi, 5)) {
    const double y = py(t);
    svg += fmt::format("<line class=\"grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", kLeft, y,
                       kLeft + pw, y);
    svg += fmt::format("<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", kLeft - 6,
                       y + 4, fmt_number(t));
  }
  for (const double t : nice_ticks(x_lo, x_hi, 8)) {
    const double x = px(t);
    svg += fmt::format("<line class=\"grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", x, kTop, x,
                       kTop + ph);
    svg += fmt::format("<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", x,
                       kTop + ph + 16, fmt_number(t));
  }
  svg += fmt::format("<line class=\"frame\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", kLeft, kTop + ph, kLeft + pw,
                     kTop + ph);
  svg +=
      fmt::format("<line class=\"frame\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\n", kLeft, kTop, kLeft, kTop + ph);
  svg += fmt::format("<text class=\"label\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", kLeft + pw / 2,
                     kHeight - 8);
  svg += fmt::format(
      "<text class=\"label\" x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>\n",
      kTop + ph / 2, kTop + ph / 2, html_escape(y_label));
  svg += "</g>\n";

  for (const Series& s : series) {
    if (s.points.empty()) continue;
    if (s.markers) {
      svg += fmt::format("<g class=\"markers\" data-series=\"{}\" fill=\"{}\">\n", html_escape(s.name), s.color);
      for (const auto& [x, y] : s.points) {
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\"><title>{} at step {}: {}</title></circle>\n",
                           px(x), py(y), html_escape(s.name), fmt_number(x), fmt_number(y));
      }
      svg += "</g>\n";
      continue;
    }
    std::string pts;
    for (const auto& [x, y] : downsample_min_max(s.points, kReportMaxPoints)) {
      if (!pts.empty()) pts += ' ';
      pts += fmt::format("{:.1f},{:.1f}", px(x), py(y));
    }
    svg += fmt::format(
        "<polyline class=\"series\" data-series=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
        "points=\"{}\"/>\n",
        html_escape(s.name), s.color, pts);
  }
  // The legend, right-aligned above the plot.
  double lx = kLeft + pw;
  for (size_t i = series.size(); i-- > 0;) {
    const Series& s = series[i];
    if (s.points.empty()) continue;
    const double w = 22 + 7.0 * static_cast<double>(s.name.size());
    lx -= w;
    svg += fmt::format(
        "<g class=\"legend\"><rect x=\"{:.1f}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{}\"/>"
        "<text x=\"{:.1f}\" y=\"{}\">{}</text></g>\n",
        lx, kTop - 14, s.color, lx + 16, kTop - 9, html_escape(s.name));
  }
  return svg + "</svg>\n</figure>\n";
}

Series series_of(const MetricsRun& run, const std::string& field, const std::string& color, bool markers = false) {
  Series s{field, color, {}, markers};
  for (const MetricsRecord& r : run.records) {
    const auto it = r.scalars.find(field);
    if (it != r.scalars.end()) s.points.emplace_back(static_cast<double>(r.step), it->second);
  }
  return s;
}

std::string summary_table(const MetricsRun& run) {
  const MetricsRecord& first = run.records.front();
  const MetricsRecord& last = run.records.back();
  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("steps", fmt::format("{} to {} ({} records)", first.step, last.step, run.records.size()));
  const auto last_with = [&](const std::string& field) -> const MetricsRecord* {
    for (auto it = run.records.rbegin(); it != run.records.rend(); ++it)
      if (it->has(field)) return &*it;
    return nullptr;
  };
  if (const MetricsRecord* r = last_with("loss"))
    rows.emplace_back("final loss", fmt::format("{:.4f} (step {})", r->scalars.at("loss"), r->step));
  const MetricsRecord* best = nullptr;
  for (const MetricsRecord& r : run.records)
    if (r.has("eval_loss") && (best == nullptr || r.scalars.at("eval_loss") < best->scalars.at("eval_loss"))) best = &r;
  rows.emplace_back("best eval loss",
                    best ? fmt::format("{:.4f} (step {})", best->scalars.at("eval_loss"), best->step) : "no eval");
  double tps = 0.0, peak = -1.0, tokens = 0.0;
  int64_t tps_count = 0;
  for (const MetricsRecord& r : run.records) {
    if (r.has("tokens_per_s")) tps += r.scalars.at("tokens_per_s"), ++tps_count;
    if (r.has("peak_mem_bytes")) peak = std::max(peak, r.scalars.at("peak_mem_bytes"));
    if (r.has("tokens")) tokens += r.scalars.at("tokens");
  }
  rows.emplace_back("mean tokens/s", tps_count > 0 ? fmt::format("{:.0f}", tps / static_cast<double>(tps_count)) : "-");
  rows.emplace_back("peak memory", peak >= 0.0 ? fmt_bytes(peak) : "-");
  if (tokens > 0.0) rows.emplace_back("tokens", fmt::format("{:.0f}", tokens));
  if (const MetricsRecord* r = last_with("elapsed_s"))
    rows.emplace_back("wall time (last run)", fmt_duration(r->scalars.at("elapsed_s")));
  if (const MetricsRecord* r = last_with("lr"))
    rows.emplace_back("final learning rate", fmt_number(r->scalars.at("lr")));
  std::string html = "<table class=\"summary\" id=\"summary\">\n";
  for (const auto& [k, v] : rows)
    html += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html_escape(k), html_escape(v));
  return html + "</table>\n";
}

constexpr const char* kStyle = R"(
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; background: #fafafa;
       margin: 0 auto; max-width: 1500px; padding: 16px 24px; }
h1 { font-size: 22px; margin: 4px 0 12px; }
h2 { font-size: 17px; margin: 22px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 14px 0 4px; font-family: ui-monospace, monospace; }
table.summary { border-collapse: collapse; background: #fff; border: 1px solid #ddd; }
table.summary th { text-align: left; font-weight: 600; padding: 4px 16px 4px 10px; color: #555; }
table.summary td { padding: 4px 10px; font-variant-numeric: tabular-nums; }
table.summary tr:nth-child(odd) { background: #f3f5f8; }
.charts { display: flex; flex-wrap: wrap; gap: 14px; }
figure.chart { margin: 0; background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: 6px 8px 2px; }
figure.chart figcaption { font-weight: 600; font-size: 14px; }
figure.chart svg { display: block; max-width: 100%; height: auto; }
svg rect.plot { fill: #fff; }
svg line.grid { stroke: #e6e6e6; stroke-width: 1; }
svg line.frame { stroke: #444; stroke-width: 1; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
svg text.label { font-size: 12px; fill: #222; }
svg text.empty { fill: #999; font-size: 13px; }
pre { background: #fff; border: 1px solid #ddd; padding: 8px 10px; overflow-x: auto; font-size: 12px; }
ul.warnings { color: #8a5300; }
)";

}  // namespace

std::string html_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

MetricsRun parse_metrics_jsonl(const std::string& text, const std::string& source) {
  MetricsRun run;
  std::vector<MetricsRecord> records;
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    const bool complete = end != std::string::npos;
    std::string line = text.substr(pos, complete ? end - pos : std::string::npos);
    pos = complete ? end + 1 : text.size();
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", source, line_no);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      // The writer appends whole lines and flushes: only the last one, cut before its newline, can be partial.
      MT_CHECK(!complete, "{}: malformed JSON line (expected one metrics record per line): {}", where,
               line.substr(0, 80));
      run.warnings.push_back(fmt::format("{}: skipped a truncated last line (the run stopped mid-write)", where));
      continue;
    }
    MetricsRecord r = record_from_json(j, where);
    if (!records.empty() && r.step <= records.back().step) {
      // A resumed run goes back to its checkpoint's step: what the first run logged from there on is superseded.
      const auto first_gone =
          std::find_if(records.begin(), records.end(), [&](const MetricsRecord& old) { return old.step >= r.step; });
      run.warnings.push_back(fmt::format("{}: the steps go back from {} to {} (a resumed run): its records replace {}",
                                         where, records.back().step, r.step, std::distance(first_gone, records.end())));
      records.erase(first_gone, records.end());
    }
    records.push_back(std::move(r));
  }
  MT_CHECK(!records.empty(), "{}: no metrics record (the file is empty; expected one JSON object per line)", source);
  run.records = std::move(records);
  return run;
}

MetricsRun read_metrics_jsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "report: cannot open the metrics file '{}'", path);
  std::ostringstream text;
  text << in.rdbuf();
  return parse_metrics_jsonl(text.str(), path);
}

std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points) {
  if (points.size() <= max_points || max_points < 2) return points;
  const size_t buckets = max_points / 2;
  std::vector<std::pair<double, double>> out;
  out.reserve(2 * buckets);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = b * points.size() / buckets, hi = (b + 1) * points.size() / buckets;
    size_t i_min = lo, i_max = lo;
    for (size_t i = lo; i < hi; ++i) {
      if (points[i].second < points[i_min].second) i_min = i;
      if (points[i].second > points[i_max].second) i_max = i;
    }
    out.push_back(points[std::min(i_min, i_max)]);
    if (i_min != i_max) out.push_back(points[std::max(i_min, i_max)]);
  }
  return out;
}

std::string render_report_html(const MetricsRun& run, const ReportInputs& inputs) {
  MT_CHECK(!run.records.empty(), "report: the run has no metrics record");
  std::string html = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n";
  html += fmt::format("<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n", html_escape(inputs.title), kStyle);
  html += fmt::format("<h1>moetrain run report: {}</h1>\n", html_escape(inputs.title));
  html += "<h2>Summary</h2>\n" + summary_table(run);
  if (!run.warnings.empty()) {
    html += "<ul class=\"warnings\">\n";
    for (const std::string& w : run.warnings) html += "<li>" + html_escape(w) + "</li>\n";
    html += "</ul>\n";
  }

  html += "<h2>Training curves</h2>\n<div class=\"charts\">\n";
  html += render_chart("loss", "Loss (train, and eval when evaluated)", "cross-entropy",
                       {series_of(run, "loss", kPalette[0]), series_of(run, "eval_loss", kPalette[1], true)});
  html += render_chart("lr", "Learning rate", "lr", {series_of(run, "lr", kPalette[2])});
  html += render_chart("grad_norm", "Gradient norm (before clipping)", "grad norm",
                       {series_of(run, "grad_norm", kPalette[3])});
  html += render_chart("tokens_per_s", "Throughput", "tokens/s", {series_of(run, "tokens_per_s", kPalette[4])});
  std::vector<Series> balance{series_of(run, "lb_loss", kPalette[5])};
  html += render_chart("load_balance", "Load-balance loss", "lb_loss", balance);
  size_t layers = 0;
  for (const MetricsRecord& r : run.records) layers = std::max(layers, r.layer_load_balance.size());
  if (layers > 0) {
    std::vector<Series> per_layer;
    for (size_t l = 0; l < layers; ++l) {
      Series s{fmt::format("L{}", l), kPalette[l % std::size(kPalette)], {}, false};
      for (const MetricsRecord& r : run.records) {
        if (l < r.layer_load_balance.size() && std::isfinite(r.layer_load_balance[l]))
          s.points.emplace_back(static_cast<double>(r.step), r.layer_load_balance[l]);
      }
      per_layer.push_back(std::move(s));
    }
    html += render_chart("layer_load_balance", "Load balance per MoE layer (1.0 = balanced)", "balance", per_layer);
  }
  html += "</div>\n";

  html += "<h2>Configuration</h2>\n<div id=\"config\">\n";
  if (inputs.configs.empty()) {
    html += "<p>No configuration was given (moetrain report --config job.toml).</p>\n";
  } else {
    html += "<p>The files as they are now; overrides given to <code>moetrain train</code> are not in them.</p>\n";
  }
  for (const ReportFile& f : inputs.configs)
    html += fmt::format("<h3>{}</h3>\n<pre class=\"config\">{}</pre>\n", html_escape(f.name), html_escape(f.text));
  html += "</div>\n</body>\n</html>\n";
  return html;
}

}  // namespace moetrain::train
