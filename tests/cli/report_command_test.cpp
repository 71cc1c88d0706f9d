// Tests for `moetrain report` and train/report_html.h: the metrics JSONL reader (truncated last line, malformed line,
// empty file, resumed run), the min/max downsampling, and the page's structure: well-formed tags, one chart per
// metric with the expected number of points, eval dots, per-layer lines, the escaped configuration, no external URL.
#include "cli/report_command.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli/commands.h"
#include "core/error.h"
#include "testing/test_data.h"
#include "train/report_html.h"

namespace moetrain::cli {
namespace {

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "moetrain");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_main(static_cast<int>(argv.size()), argv.data());
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string record(int step, bool eval, int layers) {
  std::string line = "{\"step\":" + std::to_string(step) + ",\"loss\":" + std::to_string(5.0 - 0.01 * step) +
                     ",\"lb_loss\":1.02,\"z_loss\":0.3,\"lr\":" + std::to_string(1e-3 * step / (step + 10.0)) +
                     ",\"grad_norm\":" + std::to_string(1.0 + (step % 7) * 0.1) +
                     ",\"tokens\":1024,\"tokens_per_s\":" + std::to_string(9000 + step) +
                     ",\"tflops\":0,\"mfu\":0,\"peak_mem_bytes\":" + std::to_string(100000000 + step) +
                     ",\"step_s\":0.1,\"elapsed_s\":" + std::to_string(0.1 * step);
  if (eval) line += ",\"eval_loss\":" + std::to_string(5.1 - 0.01 * step) + ",\"eval_tokens\":4096";
  if (layers > 0) {
    line += ",\"layer_load_balance\":[";
    for (int l = 0; l < layers; ++l) line += (l ? "," : "") + std::to_string(1.0 + 0.01 * l + 0.001 * step);
    line += "]";
  }
  return line + "}\n";
}

// The number of "x,y" pairs in the points attribute of the polyline whose data-series is `series`; -1 if none.
int polyline_points(const std::string& html, const std::string& chart, const std::string& series) {
  const size_t at = html.find("id=\"chart-" + chart + "\"");
  if (at == std::string::npos) return -1;
  const size_t end = html.find("</figure>", at);
  const size_t line = html.find("data-series=\"" + series + "\"", at);
  if (line == std::string::npos || line > end) return -1;
  const size_t p = html.find("points=\"", line) + 8;
  const std::string points = html.substr(p, html.find('"', p) - p);
  return static_cast<int>(std::count(points.begin(), points.end(), ','));
}

// Every tag closed in order (the page is written XML-well-formed: void elements self-closed); returns the problem.
std::string check_tags_balanced(const std::string& html) {
  std::vector<std::string> open;
  size_t pos = 0;
  while ((pos = html.find('<', pos)) != std::string::npos) {
    const size_t end = html.find('>', pos);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(pos);
    const std::string tag = html.substr(pos + 1, end - pos - 1);
    pos = end + 1;
    if (tag.rfind("!DOCTYPE", 0) == 0) continue;
    if (!tag.empty() && tag.back() == '/') continue;  // self-closed
    if (!tag.empty() && tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes <" + (open.empty() ? "" : open.back()) + ">";
      open.pop_back();
      continue;
    }
    open.push_back(tag.substr(0, tag.find_first_of(" \n\t")));
  }
  return open.empty() ? "" : "<" + open.back() + "> never closed";
}

TEST(ReportCommand, WritesAWellFormedSelfContainedPage) {
  const std::string dir = testing::make_temp_dir("report");
  {
    std::ofstream out(dir + "/metrics.jsonl");
    for (int step = 1; step <= 50; ++step) out << record(step, step % 10 == 0, 3);
  }
  std::ofstream(dir + "/job.toml") << "# a <script>alert(1)</script> & co\n[model]\nconfig = \"model\"\n";
  std::filesystem::create_directories(dir + "/model");
  std::ofstream(dir + "/model/config.json") << "{\"model_type\": \"qwen3_moe\", \"note\": \"a<b\"}\n";
  ASSERT_EQ(
      run({"report", "--metrics", dir + "/metrics.jsonl", "--out", dir + "/run.html", "--config", dir + "/job.toml"}),
      0);
  const std::string html = read(dir + "/run.html");
  EXPECT_EQ(check_tags_balanced(html), "");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  // One chart per metric, each a full line of 50 steps.
  EXPECT_EQ(polyline_points(html, "loss", "loss"), 50);
  EXPECT_EQ(polyline_points(html, "lr", "lr"), 50);
  EXPECT_EQ(polyline_points(html, "grad_norm", "grad_norm"), 50);
  EXPECT_EQ(polyline_points(html, "tokens_per_s", "tokens_per_s"), 50);
  EXPECT_EQ(polyline_points(html, "load_balance", "lb_loss"), 50);
  for (const char* layer : {"L0", "L1", "L2"}) EXPECT_EQ(polyline_points(html, "layer_load_balance", layer), 50);
  EXPECT_EQ(polyline_points(html, "layer_load_balance", "L3"), -1);
  // Eval loss as 5 dots, each with its hover title.
  const size_t eval = html.find("data-series=\"eval_loss\"");
  ASSERT_NE(eval, std::string::npos);
  const std::string dots = html.substr(eval, html.find("</g>", eval) - eval);
  size_t circles = 0;
  for (size_t p = 0; (p = dots.find("<circle", p)) != std::string::npos; ++p) ++circles;
  EXPECT_EQ(circles, 5u);
  EXPECT_NE(dots.find("eval_loss at step 50"), std::string::npos);
  // Every chart has axes with ticks, a title and a y label.
  for (const char* chart : {"loss", "lr", "grad_norm", "tokens_per_s", "load_balance", "layer_load_balance"}) {
    const size_t at = html.find(std::string("id=\"chart-") + chart + "\"");
    ASSERT_NE(at, std::string::npos) << chart;
    const std::string fig = html.substr(at, html.find("</figure>", at) - at);
    EXPECT_NE(fig.find("<figcaption>"), std::string::npos) << chart;
    EXPECT_NE(fig.find("<title>"), std::string::npos) << chart;
    EXPECT_NE(fig.find("class=\"tick\""), std::string::npos) << chart;
    EXPECT_NE(fig.find(">step</text>"), std::string::npos) << chart;
  }
  // The summary.
  EXPECT_NE(html.find("<th>final loss</th><td>4.5000 (step 50)</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>best eval loss</th><td>4.6000 (step 50)</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>mean tokens/s</th><td>9026</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>peak memory</th><td>95.4 MiB</td>"), std::string::npos);
  // The configuration: both files, escaped.
  EXPECT_NE(html.find("# a &lt;script&gt;alert(1)&lt;/script&gt; &amp; co"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_NE(html.find("&quot;note&quot;: &quot;a&lt;b&quot;"), std::string::npos);
  // Nothing outside the page: no URL at all, no src or href.
  EXPECT_EQ(html.find("http"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("href="), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ReportCommand, RunsWithoutEvalLayersOrConfig) {
  const std::string dir = testing::make_temp_dir("report");
  {
    std::ofstream out(dir + "/metrics.jsonl");
    for (int step = 1; step <= 7; ++step) out << record(step, false, 0);
  }
  ASSERT_EQ(run({"report", "--metrics", dir + "/metrics.jsonl", "--out", dir + "/run.html"}), 0);
  const std::string html = read(dir + "/run.html");
  EXPECT_EQ(check_tags_balanced(html), "");
  EXPECT_EQ(polyline_points(html, "loss", "loss"), 7);
  EXPECT_EQ(html.find("data-series=\"eval_loss\""), std::string::npos);
  EXPECT_EQ(html.find("chart-layer_load_balance"), std::string::npos);
  EXPECT_NE(html.find("<th>best eval loss</th><td>no eval</td>"), std::string::npos);
  EXPECT_NE(html.find("No configuration was given"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ReportCommand, RefusesToWriteOverItsInput) {
  const std::string dir = testing::make_temp_dir("report");
  std::ofstream(dir + "/metrics.jsonl") << record(1, false, 0);
  EXPECT_NE(run({"report", "--metrics", dir + "/metrics.jsonl", "--out", dir + "/metrics.jsonl"}), 0);
  EXPECT_EQ(read(dir + "/metrics.jsonl"), record(1, false, 0));
  EXPECT_NE(run({"report", "--metrics", dir + "/missing.jsonl", "--out", dir + "/run.html"}), 0);
  EXPECT_FALSE(std::filesystem::exists(dir + "/run.html"));
  std::filesystem::remove_all(dir);
}

TEST(ReportHtml, SkipsATruncatedLastLineWithAWarning) {
  const train::MetricsRun run =
      train::parse_metrics_jsonl(record(1, false, 0) + record(2, false, 0) + "{\"step\":3,\"loss\":4.", "m.jsonl");
  ASSERT_EQ(run.records.size(), 2u);
  EXPECT_EQ(run.records.back().step, 2);
  ASSERT_EQ(run.warnings.size(), 1u);
  EXPECT_NE(run.warnings[0].find("m.jsonl:3"), std::string::npos);
}

TEST(ReportHtml, RefusesAMalformedLineNamingIt) {
  try {
    train::parse_metrics_jsonl(record(1, false, 0) + "{\"step\":2,\"loss\":\n" + record(3, false, 0), "m.jsonl");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("m.jsonl:2: malformed JSON line"), std::string::npos) << e.what();
  }
  // A complete last line (newline written) that does not parse is not a crash mid-write.
  EXPECT_THROW(train::parse_metrics_jsonl(record(1, false, 0) + "{oops}\n", "m.jsonl"), Error);
  EXPECT_THROW(train::parse_metrics_jsonl("{\"loss\": 1.0}\n", "m.jsonl"), Error);  // no step
  EXPECT_THROW(train::parse_metrics_jsonl("[1, 2]\n", "m.jsonl"), Error);
  EXPECT_THROW(train::parse_metrics_jsonl("{\"step\":1,\"layer_load_balance\":\"x\"}\n", "m.jsonl"), Error);
}

TEST(ReportHtml, RefusesAnEmptyFile) {
  EXPECT_THROW(train::parse_metrics_jsonl("", "m.jsonl"), Error);
  EXPECT_THROW(train::parse_metrics_jsonl("\n  \n", "m.jsonl"), Error);
}

TEST(ReportHtml, AResumedRunKeepsTheLastRecordOfEachStep) {
  std::string text;
  for (int step = 1; step <= 6; ++step) text += record(step, false, 0);
  // Resumed from the checkpoint of step 4: steps 5 and 6 again, with other values, then on to 8.
  for (int step = 5; step <= 8; ++step)
    text += "{\"step\":" + std::to_string(step) + ",\"loss\":" + std::to_string(step) + "}\n";
  const train::MetricsRun run = train::parse_metrics_jsonl(text, "m.jsonl");
  ASSERT_EQ(run.records.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(run.records[i].step, static_cast<int64_t>(i + 1));
  EXPECT_DOUBLE_EQ(run.records[4].scalars.at("loss"), 5.0);
  EXPECT_DOUBLE_EQ(run.records[5].scalars.at("loss"), 6.0);
  EXPECT_FALSE(run.records[5].has("lr"));  // the first run's step-6 record is gone whole
  ASSERT_EQ(run.warnings.size(), 1u);
  EXPECT_NE(run.warnings[0].find("from 6 to 5"), std::string::npos);
}

TEST(ReportHtml, DownsamplesLongRunsKeepingEveryBucketsExtremes) {
  std::vector<std::pair<double, double>> points;
  for (int i = 0; i < 10000; ++i) points.emplace_back(i, std::sin(i * 0.01) + (i == 4321 ? 50.0 : 0.0));
  const auto small = train::downsample_min_max(points, train::kReportMaxPoints);
  EXPECT_LE(small.size(), train::kReportMaxPoints);
  EXPECT_GE(small.size(), train::kReportMaxPoints - 2);
  EXPECT_TRUE(std::is_sorted(small.begin(), small.end()));
  EXPECT_NE(std::find(small.begin(), small.end(), points[4321]), small.end());   // the spike survives
  EXPECT_EQ(small, train::downsample_min_max(points, train::kReportMaxPoints));  // deterministic
  EXPECT_EQ(train::downsample_min_max(std::vector<std::pair<double, double>>(points.begin(), points.begin() + 2000),
                                      train::kReportMaxPoints)
                .size(),
            2000u);
  // The page of a long run stays small: one line of at most 2000 points.
  std::string text;
  for (int step = 1; step <= 10000; ++step) text += record(step, false, 0);
  const std::string html = train::render_report_html(train::parse_metrics_jsonl(text, "m.jsonl"), {"long", {}});
  const int drawn = polyline_points(html, "loss", "loss");
  EXPECT_GT(drawn, 1000);
  EXPECT_LE(drawn, 2000);
}

}  // namespace
}  // namespace moetrain::cli
