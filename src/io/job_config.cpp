// defines: the job TOML reader, the --section.key=value overrides, the validation and the TOML
// writer of job_config.h. Every scalar key is listed once (field_refs) with a typed pointer into
// the config, so reading the file, applying an override and writing TOML walk the same list.
#include "io/job_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>

#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "core/error.h"

namespace moetrain::io {

namespace {

// Bounds on job sizes, far above any real run: rows of 2^24 tokens, 2^20 micro-batches per step, 1024 thread ranks.
constexpr int64_t kMaxJobExtent = int64_t{1} << 24;
constexpr int64_t kMaxMicroBatchesPerStep = int64_t{1} << 20;
constexpr int64_t kMaxLocalRanks = 1024;

namespace fs = std::filesystem;

// A string key holding a path: a relative value resolves against the TOML file's folder (file)
// or the current directory (override); an empty value stays empty ("not set").
struct PathField {
  std::string* value;
};
// data.path, the shorthand that replaces every data source with one of weight 1.
struct DataPathField {
  std::vector<DataSource>* sources;
};

using Target =
    std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, PathField, DataPathField, std::vector<int64_t>*>;

struct FieldRef {
  std::string_view key;  // "section.key"
  Target target;
};

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

constexpr std::string_view kSourcesKey = "data.sources";
constexpr std::string_view kEvalSourcesKey = "eval.sources";  // [[eval.sources]], read like data.sources

// Every scalar key, in the order job_config_to_toml writes them. data.sources is read apart.
std::vector<FieldRef> field_refs(JobConfig& c) {
  return {
      {"model.config", PathField{&c.model.config}},
      {"model.init", &c.model.init},
      {"model.init_std", &c.model.init_std},
      {"model.device", &c.model.device},
      {"model.compute_dtype", &c.model.compute_dtype},
      {"model.residual_dtype", &c.model.residual_dtype},
      {"model.recompute", &c.model.recompute},
      {"model.expert_weight_gradient", &c.model.expert_weight_gradient},
      {"model.head_chunk", &c.model.head_chunk},
      {"data.path", DataPathField{&c.data.sources}},
      {"data.mode", &c.data.mode},
      {"data.shuffle", &c.data.shuffle},
      {"train.steps", &c.train.steps},
      {"train.seq_len", &c.train.seq_len},
      {"train.micro_batch", &c.train.micro_batch},
      {"train.global_batch", &c.train.global_batch},
      {"train.global_batch_tokens", &c.train.global_batch_tokens},
      {"train.seed", &c.train.seed},
      {"optim.lr", &c.optim.lr},
      {"optim.beta1", &c.optim.beta1},
      {"optim.beta2", &c.optim.beta2},
      {"optim.eps", &c.optim.eps},
      {"optim.weight_decay", &c.optim.weight_decay},
      {"optim.schedule", &c.optim.schedule},
      {"optim.warmup_steps", &c.optim.warmup_steps},
      {"optim.min_lr_ratio", &c.optim.min_lr_ratio},
      {"optim.decay_fraction", &c.optim.decay_fraction},
      {"optim.clip_grad_norm", &c.optim.clip_grad_norm},
      {"optim.state_dtype", &c.optim.state_dtype},
      {"loss.load_balance", &c.loss.load_balance},
      {"loss.load_balance_coef", &c.loss.load_balance_coef},
      {"loss.z_loss_coef", &c.loss.z_loss_coef},
      {"loss.device_balance_coef", &c.loss.device_balance_coef},
      {"loss.device_balance_groups", &c.loss.device_balance_groups},
      {"checkpoint.dir", PathField{&c.checkpoint.dir}},
      {"checkpoint.every", &c.checkpoint.every},
      {"checkpoint.keep", &c.checkpoint.keep},
      {"checkpoint.resume", &c.checkpoint.resume},
      {"metrics.jsonl", PathField{&c.metrics.jsonl}},
      {"metrics.console_every", &c.metrics.console_every},
      {"metrics.tensorboard", PathField{&c.metrics.tensorboard}},
      {"parallel.pp", &c.parallel.pp},
      {"parallel.ep", &c.parallel.ep},
      {"parallel.cp", &c.parallel.cp},
      {"parallel.pp_cuts", &c.parallel.pp_cuts},
      {"parallel.sharding", &c.parallel.sharding},
      {"parallel.reduce_gradients", &c.parallel.reduce_gradients},
      {"parallel.schedule", &c.parallel.schedule},
      {"parallel.ep_dedup", &c.parallel.ep_dedup},
      {"dist.local_ranks", &c.dist.local_ranks},
      {"dist.timeout_s", &c.dist.timeout_s},
      {"exact.enabled", &c.exact.enabled},
      {"eval.path", DataPathField{&c.eval.sources}},
      {"eval.every", &c.eval.every},
      {"eval.tokens", &c.eval.tokens},
      {"eval.micro_batch", &c.eval.micro_batch},
  };
}

std::string_view section_of(std::string_view key) { return key.substr(0, key.find('.')); }
std::string_view leaf_of(std::string_view key) { return key.substr(key.rfind('.') + 1); }

std::vector<std::string> known_keys() {
  JobConfig scratch;
  std::vector<std::string> keys;
  for (const FieldRef& ref : field_refs(scratch)) keys.emplace_back(ref.key);
  keys.emplace_back(kSourcesKey);
  keys.emplace_back(kEvalSourcesKey);
  return keys;
}

std::vector<std::string> known_sections() {
  std::vector<std::string> sections;
  for (const std::string& key : known_keys()) {
    const std::string section(section_of(key));
    if (std::find(sections.begin(), sections.end(), section) == sections.end()) sections.push_back(section);
  }
  return sections;
}

// Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
// neighbouring characters each cost 1 ("setps" is 1 away from "steps").
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// "; did you mean 'x'?" for the closest candidate within edit distance 2, else for a candidate
// with the same last component (a key put in the wrong section), else "".
std::string suggestion(std::string_view name, const std::vector<std::string>& candidates) {
  const std::string* best = nullptr;
  size_t best_distance = 3;
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(name, candidate);
    if (distance < best_distance) {
      best = &candidate;
      best_distance = distance;
    }
  }
  if (best == nullptr) {
    for (const std::string& candidate : candidates) {
      if (candidate != name && leaf_of(candidate) == leaf_of(name)) {
        best = &candidate;
        break;
      }
    }
  }
  return best == nullptr ? std::string() : fmt::format("; did you mean '{}'?", *best);
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// `value` resolved against `base` (an absolute folder) unless it is empty or already absolute.
std::string resolve_path(const std::string& value, const fs::path& base) {
  if (value.empty() || fs::path(value).is_absolute()) return value;
  return (base / value).lexically_normal().string();
}

// The folder relative paths of a file named `source` resolve against (absolute).
fs::path base_folder_of(const std::string& source) {
  const fs::path parent = fs::path(source).parent_path();
  return parent.empty() ? fs::current_path() : fs::absolute(parent);
}

const char* node_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

// How a found node reads in an error: its type, and its text for a scalar.
std::string found_str(const toml::node& node) {
  if (node.is_table() || node.is_array()) return node_type_name(node);
  std::ostringstream text;
  node.visit([&](const auto& value) { text << value; });
  std::string shown = text.str();
  if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
  return fmt::format("{} ({})", node_type_name(node), shown);
}

std::string location(const toml::source_region& where) {
  return fmt::format("line {}, column {}", where.begin.line, where.begin.column);
}

// Reads the parsed TOML document into a JobConfig, naming `source` and the line in every error.
class FileReader {
 public:
  FileReader(std::string source, fs::path base) : source_(std::move(source)), base_(std::move(base)) {}

  void read(const toml::table& root, JobConfig& config) const {
    const std::vector<std::string> keys = known_keys();
    const std::vector<std::string> sections = known_sections();
    std::vector<FieldRef> refs = field_refs(config);
    bool has_data_path = false;
    bool has_sources = false;
    bool has_eval_path = false;
    bool has_eval_sources = false;
    for (const auto& [section_key, section_node] : root) {
      const std::string section(section_key.str());
      if (std::find(sections.begin(), sections.end(), section) == sections.end()) {
        if (section_node.is_table()) {
          fail(section_key.source(), fmt::format("unknown section '{}' (sections: {})", section, join(sections)),
               suggestion(section, sections));
        }
        fail(section_key.source(), fmt::format("unknown key '{}'", section), suggestion(section, keys));
      }
      const toml::table* table = section_node.as_table();
      if (table == nullptr) {
        fail(section_node.source(),
             fmt::format("key '{}' must be a table ([{}]) but found {}", section, section, found_str(section_node)));
      }
      for (const auto& [leaf, node] : *table) {
        const std::string key = section + "." + std::string(leaf.str());
        if (key == kSourcesKey) {
          read_sources(node, config.data.sources, kSourcesKey);
          has_sources = true;
          continue;
        }
        if (key == kEvalSourcesKey) {
          read_sources(node, config.eval.sources, kEvalSourcesKey);
          has_eval_sources = true;
          continue;
        }
        const auto ref = std::find_if(refs.begin(), refs.end(), [&](const FieldRef& r) { return r.key == key; });
        if (ref == refs.end()) fail(leaf.source(), fmt::format("unknown key '{}'", key), suggestion(key, keys));
        assign(*ref, node);
        has_data_path = has_data_path || key == "data.path";
        has_eval_path = has_eval_path || key == "eval.path";
      }
    }
    if (has_eval_path && has_eval_sources) {
      MT_FAIL(
          "{}: eval.path and [[eval.sources]] are both set; use eval.path for one held-out source or "
          "[[eval.sources]] for several",
          source_);
    }
    if (has_data_path && has_sources) {
      MT_FAIL(
          "{}: data.path and [[data.sources]] are both set; use data.path for one source or [[data.sources]] for "
          "several",
          source_);
    }
  }

 private:
  // "<source>: <what> (line L, column C)<hint>": the hint ("; did you mean ...") comes last.
  [[noreturn]] void fail(const toml::source_region& where, const std::string& what,
                         const std::string& hint = "") const {
    MT_FAIL("{}: {} ({}){}", source_, what, location(where), hint);
  }
  [[noreturn]] void fail_type(const std::string& key, const char* expected, const toml::node& node) const {
    fail(node.source(), fmt::format("key '{}' expects {} but found {}", key, expected, found_str(node)));
  }

  int64_t int_of(const std::string& key, const toml::node& node) const {
    if (const auto* v = node.as_integer()) return v->get();
    fail_type(key, "an integer", node);
  }
  double float_of(const std::string& key, const toml::node& node) const {
    if (const auto* v = node.as_floating_point()) return v->get();
    if (const auto* v = node.as_integer()) return static_cast<double>(v->get());
    fail_type(key, "a float", node);
  }
  bool bool_of(const std::string& key, const toml::node& node) const {
    if (const auto* v = node.as_boolean()) return v->get();
    fail_type(key, "a boolean (true or false)", node);
  }
  std::string string_of(const std::string& key, const toml::node& node) const {
    if (const auto* v = node.as_string()) return v->get();
    fail_type(key, "a string", node);
  }

  std::vector<int64_t> int_list_of(const std::string& key, const toml::node& node) const {
    const toml::array* array = node.as_array();
    if (array == nullptr) fail_type(key, "an array of integers (e.g. [2, 4, 6])", node);
    std::vector<int64_t> values;
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& element = *array->get(i);
      const auto* v = element.as_integer();
      if (v == nullptr) {
        fail(element.source(),
             fmt::format("key '{}' expects an array of integers but element {} is {}", key, i, found_str(element)));
      }
      values.push_back(v->get());
    }
    return values;
  }

  void assign(const FieldRef& ref, const toml::node& node) const {
    const std::string key(ref.key);
    std::visit(Overloaded{
                   [&](int64_t* p) { *p = int_of(key, node); },
                   [&](uint64_t* p) {
                     const int64_t value = int_of(key, node);
                     if (value < 0) {
                       fail(node.source(),
                            fmt::format("key '{}' expects a non-negative integer but found {}", key, found_str(node)));
                     }
                     *p = static_cast<uint64_t>(value);
                   },
                   [&](double* p) { *p = float_of(key, node); },
                   [&](bool* p) { *p = bool_of(key, node); },
                   [&](std::string* p) { *p = string_of(key, node); },
                   [&](PathField f) { *f.value = resolve_path(string_of(key, node), base_); },
                   [&](DataPathField f) {
                     *f.sources = {DataSource{resolve_path(string_of(key, node), base_), 1.0}};
                   },
                   [&](std::vector<int64_t>* p) { *p = int_list_of(key, node); },
               },
               ref.target);
  }

  // [[data.sources]] or [[eval.sources]] (`sources_key`).
  void read_sources(const toml::node& node, std::vector<DataSource>& sources, std::string_view sources_key) const {
    const toml::array* array = node.as_array();
    if (array == nullptr) {
      fail(node.source(), fmt::format("key '{}' must be an array of tables ([[{}]]) but found {}", sources_key,
                                      sources_key, found_str(node)));
    }
    sources.clear();
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& element = *array->get(i);
      const std::string name = fmt::format("{}[{}]", sources_key, i);
      const toml::table* table = element.as_table();
      if (table == nullptr) {
        fail(element.source(),
             fmt::format("'{}' must be a table with path and weight but found {}", name, found_str(element)));
      }
      DataSource source;
      bool has_path = false;
      const std::vector<std::string> candidates = {name + ".path", name + ".weight"};
      for (const auto& [leaf, value] : *table) {
        const std::string key = name + "." + std::string(leaf.str());
        if (key == candidates[0]) {
          source.path = resolve_path(string_of(key, value), base_);
          has_path = true;
        } else if (key == candidates[1]) {
          source.weight = float_of(key, value);
        } else {
          fail(leaf.source(), fmt::format("unknown key '{}'", key), suggestion(key, candidates));
        }
      }
      if (!has_path) fail(element.source(), fmt::format("'{}' has no path (the indexed dataset prefix)", name));
      sources.push_back(std::move(source));
    }
  }

  std::string source_;
  fs::path base_;
};

// A single TOML value written after "v = " (underscores, hex, +inf, ...), or nullopt.
// The first byte outside the ASCII range, as (line, column), both from 1. toml++ 3.4's unicode whitespace check
// reaches a TOML_UNREACHABLE on some code points where it reads code rather than a string or a comment (U+0290 at the
// start of a line, or after a string that held a '#': the job_config fuzz target's findings); telling where toml++
// reads code takes toml++'s own lexer, so every non-ASCII byte is refused here, before toml++ sees the text. A job file
// is ASCII: a string writes other characters as \uXXXX escapes (as the writer does).
std::optional<std::pair<int64_t, int64_t>> first_non_ascii(std::string_view text) {
  int64_t line = 1, column = 0;
  for (const char c : text) {
    ++column;
    if (c == '\n') {
      ++line, column = 0;
    } else if (static_cast<unsigned char>(c) >= 0x80) {
      return std::pair{line, column};
    }
  }
  return std::nullopt;
}

std::optional<toml::table> parse_toml_value(std::string_view text) {
  if (text.empty() || text.find_first_of("\n\r#") != std::string_view::npos) return std::nullopt;
  if (first_non_ascii(text)) return std::nullopt;
  try {
    toml::table table = toml::parse("v = " + std::string(text));
    if (table.size() == 1 && table.contains("v")) return table;
  } catch (const toml::parse_error&) {
  }
  return std::nullopt;
}

// Drops one leading '+' (which std::from_chars refuses) unless a second sign follows.
std::optional<std::string_view> strip_plus(std::string_view text) {
  if (!text.empty() && text[0] == '+') {
    text.remove_prefix(1);
    if (text.empty() || text[0] == '+' || text[0] == '-') return std::nullopt;
  }
  return text;
}

std::optional<int64_t> parse_int(std::string_view text) {
  if (const auto digits = strip_plus(text)) {
    int64_t value = 0;
    const auto [end, ec] = std::from_chars(digits->data(), digits->data() + digits->size(), value);
    if (ec == std::errc() && end == digits->data() + digits->size()) return value;
  }
  if (const auto table = parse_toml_value(text)) {
    if (const auto* v = table->get("v")->as_integer()) return v->get();
  }
  return std::nullopt;
}

std::optional<double> parse_float(std::string_view text) {
  if (const auto digits = strip_plus(text)) {
    double value = 0;
    const auto [end, ec] = std::from_chars(digits->data(), digits->data() + digits->size(), value);
    if (ec == std::errc() && end == digits->data() + digits->size()) return value;
  }
  if (const auto table = parse_toml_value(text)) {
    const toml::node* v = table->get("v");
    if (const auto* f = v->as_floating_point()) return f->get();
    if (const auto* i = v->as_integer()) return static_cast<double>(i->get());
  }
  return std::nullopt;
}

// An integer list: a TOML array ("[2, 4, 6]", "[]") or bare comma-separated integers ("2,4,6"; "" is empty).
std::optional<std::vector<int64_t>> parse_int_list(std::string_view text) {
  std::string body(text);
  if (body.find('[') == std::string::npos) body = "[" + body + "]";
  const auto table = parse_toml_value(body);
  if (!table) return std::nullopt;
  const toml::array* array = table->get("v")->as_array();
  if (array == nullptr) return std::nullopt;
  std::vector<int64_t> values;
  for (size_t i = 0; i < array->size(); ++i) {
    const auto* v = array->get(i)->as_integer();
    if (v == nullptr) return std::nullopt;
    values.push_back(v->get());
  }
  return values;
}

[[noreturn]] void fail_override_value(const std::string& given, const std::string& key, const char* expected,
                                      const std::string& value) {
  MT_FAIL("override '{}': key '{}' expects {} but found '{}'", given, key, expected, value);
}

// Applies one "section.key=value" (leading "--" optional); errors name the override as given.
void apply_override(JobConfig& config, const std::string& given) {
  std::string_view text = given;
  if (text.starts_with("--")) text.remove_prefix(2);
  const size_t eq = text.find('=');
  MT_CHECK(eq != std::string_view::npos, "override '{}': expected section.key=value (e.g. --optim.lr=1e-4)", given);
  const std::string key(text.substr(0, eq));
  const std::string value(text.substr(eq + 1));
  MT_CHECK(key != kSourcesKey && !key.starts_with(std::string(kSourcesKey) + ".") &&
               !key.starts_with(std::string(kSourcesKey) + "["),
           "override '{}': {} cannot be overridden element by element; use data.path=PREFIX to replace every "
           "source with one, or edit the file",
           given, kSourcesKey);
  MT_CHECK(key != kEvalSourcesKey && !key.starts_with(std::string(kEvalSourcesKey) + ".") &&
               !key.starts_with(std::string(kEvalSourcesKey) + "["),
           "override '{}': {} cannot be overridden element by element; use eval.path=PREFIX to replace every "
           "held-out source with one, or edit the file",
           given, kEvalSourcesKey);
  std::vector<FieldRef> refs = field_refs(config);
  const auto ref = std::find_if(refs.begin(), refs.end(), [&](const FieldRef& r) { return r.key == key; });
  MT_CHECK(ref != refs.end(), "override '{}': unknown key '{}'{}", given, key, suggestion(key, known_keys()));
  const fs::path cwd = fs::current_path();
  const auto bad_value = [&](const char* expected) { fail_override_value(given, key, expected, value); };
  std::visit(Overloaded{
                 [&](int64_t* p) {
                   const auto v = parse_int(value);
                   if (!v) bad_value("an integer");
                   *p = *v;
                 },
                 [&](uint64_t* p) {
                   const auto v = parse_int(value);
                   if (!v || *v < 0) bad_value("a non-negative integer below 2^63");
                   *p = static_cast<uint64_t>(*v);
                 },
                 [&](double* p) {
                   const auto v = parse_float(value);
                   if (!v) bad_value("a float");
                   *p = *v;
                 },
                 [&](bool* p) {
                   if (value != "true" && value != "false") bad_value("a boolean (true or false)");
                   *p = value == "true";
                 },
                 [&](std::string* p) { *p = value; },
                 [&](PathField f) { *f.value = resolve_path(value, cwd); },
                 [&](DataPathField f) {
                   // Empty: no source at all (e.g. a job file's data turned synthetic from the command line).
                   *f.sources = value.empty() ? std::vector<DataSource>{}
                                              : std::vector<DataSource>{DataSource{resolve_path(value, cwd), 1.0}};
                 },
                 [&](std::vector<int64_t>* p) {
                   const auto v = parse_int_list(value);
                   if (!v) bad_value("a list of integers ([2, 4, 6] or 2,4,6; [] for none)");
                   *p = *v;
                 },
             },
             ref->target);
}

bool one_of(const std::string& value, std::initializer_list<std::string_view> allowed) {
  return std::find(allowed.begin(), allowed.end(), value) != allowed.end();
}

bool is_device(const std::string& device) {
  if (device == "cpu" || device == "cuda") return true;
  if (!device.starts_with("cuda:") || device.size() == 5) return false;
  return std::all_of(device.begin() + 5, device.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The GPU index of a "cuda:N" that is_device accepted: a number past int or past any machine is refused here (as
// parse_device would, later), naming the key, rather than failing inside a conversion.
constexpr size_t kMaxDeviceDigits = 4;
constexpr int kMaxDeviceIndex = 1024;
bool device_index_in_range(const std::string& device) {
  if (!device.starts_with("cuda:")) return true;
  return device.size() - 5 <= kMaxDeviceDigits && std::stoi(device.substr(5)) < kMaxDeviceIndex;
}

// [eval] and metrics.tensorboard (after [train] is checked): sizes bounded before the trainer plans from them, held-out
// sources named when on, and a TensorBoard folder that is not a file (checked here, before any file is written).
constexpr int64_t kMaxEvalEvery = int64_t{1} << 40;
void validate_eval_and_tensorboard(JobConfig& c, const char* s) {
  const EvalSection& e = c.eval;
  MT_CHECK(e.every >= 0, "{}: eval.every must be >= 0 (0: no evaluation) but is {}", s, e.every);
  MT_CHECK(e.every <= kMaxEvalEvery, "{}: eval.every is {}, more than the {} steps it may be (a mistyped value?)", s,
           e.every, kMaxEvalEvery);
  MT_CHECK(e.tokens >= 0, "{}: eval.tokens must be >= 0 but is {}", s, e.tokens);
  MT_CHECK(e.micro_batch >= 0 && e.micro_batch <= kMaxJobExtent,
           "{}: eval.micro_batch must be in [0, {}] (0: train.micro_batch) but is {}", s, kMaxJobExtent, e.micro_batch);
  for (size_t i = 0; i < e.sources.size(); ++i) {
    MT_CHECK(!e.sources[i].path.empty(), "{}: eval.sources[{}].path is empty (expected an indexed dataset prefix)", s,
             i);
    MT_CHECK(std::isfinite(e.sources[i].weight) && e.sources[i].weight > 0,
             "{}: eval.sources[{}].weight must be > 0 but is {}", s, i, e.sources[i].weight);
  }
  if (e.every > 0) {
    MT_CHECK(!e.sources.empty(),
             "{}: eval.every = {} but no held-out data is set: set eval.path = PREFIX or add [[eval.sources]] tables "
             "(or eval.every = 0)",
             s, e.every);
    const int64_t rows = e.micro_batch > 0 ? e.micro_batch : c.train.micro_batch;
    int64_t micro_tokens = 0;
    MT_CHECK(!__builtin_mul_overflow(rows, c.train.seq_len, &micro_tokens) &&
                 micro_tokens <= std::numeric_limits<int32_t>::max(),
             "{}: an evaluation micro-batch of eval.micro_batch x train.seq_len = {} x {} tokens is more than the {} "
             "a micro-batch may hold",
             s, rows, c.train.seq_len, std::numeric_limits<int32_t>::max());
    MT_CHECK(e.tokens >= micro_tokens,
             "{}: eval.tokens is {}, less than one evaluation micro-batch of {} x {} = {} tokens (eval.micro_batch x "
             "train.seq_len)",
             s, e.tokens, rows, c.train.seq_len, micro_tokens);
    MT_CHECK(
        e.tokens / micro_tokens < kMaxMicroBatchesPerStep,
        "{}: eval.tokens is {}, {} micro-batches of {} tokens, more than the {} an evaluation may have (a mistyped "
        "value?)",
        s, e.tokens, e.tokens / micro_tokens, micro_tokens, kMaxMicroBatchesPerStep);
  }
  const std::string& tb = c.metrics.tensorboard;
  std::error_code ec;
  MT_CHECK(tb.empty() || !fs::exists(tb, ec) || fs::is_directory(tb, ec),
           "{}: metrics.tensorboard is '{}', which exists and is not a folder (expected a folder for the event files, "
           "created when missing)",
           s, tb);
}

// Checks every rule of the header (the comparisons are written so NaN fails them) and fills the
// default global_batch. `source` names the configuration in errors.
void validate(JobConfig& c, const std::string& source) {
  const char* s = source.c_str();
  MT_CHECK(!c.model.config.empty(),
           "{}: model.config is required (the HF model folder or its config.json); set it in [model] or pass "
           "--model.config=PATH",
           s);
  MT_CHECK(one_of(c.model.init, {"random", "pretrained"}), "{}: model.init must be random or pretrained but is '{}'", s,
           c.model.init);
  MT_CHECK(std::isfinite(c.model.init_std) && c.model.init_std >= 0,
           "{}: model.init_std must be finite and >= 0 but is {}", s, c.model.init_std);
  MT_CHECK(is_device(c.model.device), "{}: model.device must be cpu, cuda or cuda:N but is '{}'", s, c.model.device);
  MT_CHECK(device_index_in_range(c.model.device), "{}: model.device is '{}', expected a GPU index in [0, {})", s,
           c.model.device, kMaxDeviceIndex);
  MT_CHECK(c.model.head_chunk >= 0, "{}: model.head_chunk must be >= 0 (0: no chunking) but is {}", s,
           c.model.head_chunk);
  MT_CHECK(one_of(c.model.compute_dtype, {"f32", "bf16"}), "{}: model.compute_dtype must be f32 or bf16 but is '{}'", s,
           c.model.compute_dtype);
  MT_CHECK(one_of(c.model.recompute, {"none", "activation"}),
           "{}: model.recompute must be none or activation but is '{}'", s, c.model.recompute);
  MT_CHECK(one_of(c.model.expert_weight_gradient, {"micro_batch", "step"}),
           "{}: model.expert_weight_gradient must be micro_batch or step but is '{}'", s,
           c.model.expert_weight_gradient);
  MT_CHECK(one_of(c.model.residual_dtype, {"compute", "f32"}),
           "{}: model.residual_dtype must be compute or f32 but is '{}'", s, c.model.residual_dtype);
  MT_CHECK(c.model.compute_dtype == "f32" || c.model.device != "cpu",
           "{}: model.compute_dtype = bf16 needs a CUDA device (the CPU reference computes in f32) but model.device is "
           "cpu",
           s);

  MT_CHECK(one_of(c.data.mode, {"packed", "fixed", "synthetic"}),
           "{}: data.mode must be packed, fixed or synthetic but is '{}'", s, c.data.mode);
  const bool synthetic = c.data.mode == "synthetic";
  MT_CHECK(synthetic || !c.data.sources.empty(),
           "{}: no training data: set data.path = PREFIX or add [[data.sources]] tables", s);
  MT_CHECK(!synthetic || c.data.sources.empty(), "{}: data.mode = synthetic reads no files but data sources are set",
           s);
  for (size_t i = 0; i < c.data.sources.size(); ++i) {
    const DataSource& d = c.data.sources[i];
    MT_CHECK(!d.path.empty(), "{}: data.sources[{}].path is empty (expected an indexed dataset prefix)", s, i);
    MT_CHECK(std::isfinite(d.weight) && d.weight > 0, "{}: data.sources[{}].weight must be > 0 but is {}", s, i,
             d.weight);
  }

  TrainSection& t = c.train;
  MT_CHECK(t.steps > 0, "{}: train.steps must be > 0 but is {}", s, t.steps);
  MT_CHECK(t.seq_len > 0, "{}: train.seq_len must be > 0 but is {}", s, t.seq_len);
  MT_CHECK(t.micro_batch > 0, "{}: train.micro_batch must be > 0 but is {}", s, t.micro_batch);
  MT_CHECK(t.global_batch >= 0, "{}: train.global_batch must be >= 0 but is {}", s, t.global_batch);
  MT_CHECK(t.global_batch_tokens >= 0, "{}: train.global_batch_tokens must be >= 0 but is {}", s,
           t.global_batch_tokens);
  MT_CHECK(t.global_batch == 0 || t.global_batch_tokens == 0,
           "{}: set one of train.global_batch ({}) and train.global_batch_tokens ({}), not both; set the other to 0", s,
           t.global_batch, t.global_batch_tokens);
  if (t.global_batch == 0 && t.global_batch_tokens == 0) t.global_batch = t.micro_batch;
  MT_CHECK(t.global_batch % t.micro_batch == 0, "{}: train.global_batch ({}) must be a multiple of micro_batch ({})", s,
           t.global_batch, t.micro_batch);
  // Sizes are bounded before anything is planned or allocated from them: a step of 2^62 rows would grow the plan of
  // its micro-batches for minutes before failing.
  MT_CHECK(t.seq_len <= kMaxJobExtent, "{}: train.seq_len is {}, more than the {} tokens a row may have", s, t.seq_len,
           kMaxJobExtent);
  MT_CHECK(t.micro_batch <= kMaxJobExtent, "{}: train.micro_batch is {}, more than the {} rows a micro-batch may have",
           s, t.micro_batch, kMaxJobExtent);
  int64_t micro_tokens = 0;
  MT_CHECK(!__builtin_mul_overflow(t.micro_batch, t.seq_len, &micro_tokens),
           "{}: train.micro_batch * train.seq_len ({} * {}) overflows int64", s, t.micro_batch, t.seq_len);
  MT_CHECK(t.global_batch_tokens % micro_tokens == 0,
           "{}: train.global_batch_tokens ({}) must be a multiple of micro_batch * seq_len ({} * {} = {})", s,
           t.global_batch_tokens, t.micro_batch, t.seq_len, micro_tokens);
  const int64_t micro_batches =
      t.global_batch > 0 ? t.global_batch / t.micro_batch : t.global_batch_tokens / micro_tokens;
  MT_CHECK(micro_batches <= kMaxMicroBatchesPerStep,
           "{}: train.global_batch{} ({}) makes {} micro-batches per step, more than the {} a step may have (a "
           "mistyped value?)",
           s, t.global_batch > 0 ? "" : "_tokens", t.global_batch > 0 ? t.global_batch : t.global_batch_tokens,
           micro_batches, kMaxMicroBatchesPerStep);

  const OptimSection& o = c.optim;
  MT_CHECK(std::isfinite(o.lr) && o.lr >= 0, "{}: optim.lr must be finite and >= 0 but is {}", s, o.lr);
  MT_CHECK(o.beta1 >= 0 && o.beta1 < 1, "{}: optim.beta1 must be in [0, 1) but is {}", s, o.beta1);
  MT_CHECK(o.beta2 >= 0 && o.beta2 < 1, "{}: optim.beta2 must be in [0, 1) but is {}", s, o.beta2);
  MT_CHECK(std::isfinite(o.eps) && o.eps > 0, "{}: optim.eps must be finite and > 0 but is {}", s, o.eps);
  MT_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
           "{}: optim.weight_decay must be finite and >= 0 but is {}", s, o.weight_decay);
  MT_CHECK(one_of(o.state_dtype, {"f32", "bf16"}), "{}: optim.state_dtype must be f32 or bf16 but is '{}'", s,
           o.state_dtype);
  MT_CHECK(one_of(o.schedule, {"constant", "cosine", "linear", "wsd"}),
           "{}: optim.schedule must be constant, cosine, linear or wsd but is '{}'", s, o.schedule);
  MT_CHECK(o.warmup_steps >= 0, "{}: optim.warmup_steps must be >= 0 but is {}", s, o.warmup_steps);
  MT_CHECK(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "{}: optim.min_lr_ratio must be in [0, 1] but is {}", s,
           o.min_lr_ratio);
  MT_CHECK(o.decay_fraction > 0 && o.decay_fraction <= 1, "{}: optim.decay_fraction must be in (0, 1] but is {}", s,
           o.decay_fraction);
  MT_CHECK(!std::isnan(o.clip_grad_norm), "{}: optim.clip_grad_norm must be a number (<= 0 disables) but is {}", s,
           o.clip_grad_norm);

  const LossSection& l = c.loss;
  MT_CHECK(one_of(l.load_balance, {"micro_batch", "global_batch", "sequence"}),
           "{}: loss.load_balance must be micro_batch, global_batch or sequence but is '{}'", s, l.load_balance);
  MT_CHECK(std::isfinite(l.load_balance_coef) && l.load_balance_coef >= 0,
           "{}: loss.load_balance_coef must be finite and >= 0 but is {}", s, l.load_balance_coef);
  MT_CHECK(std::isfinite(l.z_loss_coef) && l.z_loss_coef >= 0, "{}: loss.z_loss_coef must be finite and >= 0 but is {}",
           s, l.z_loss_coef);
  MT_CHECK(std::isfinite(l.device_balance_coef) && l.device_balance_coef >= 0,
           "{}: loss.device_balance_coef must be finite and >= 0 but is {}", s, l.device_balance_coef);
  // Whether D divides the experts is checked where the model is known (model::resolve_device_balance_groups).
  MT_CHECK(l.device_balance_groups >= 0,
           "{}: loss.device_balance_groups must be >= 0 (0: the expert-parallel degree) but is {}", s,
           l.device_balance_groups);

  MT_CHECK(c.checkpoint.every >= 0, "{}: checkpoint.every must be >= 0 (0: only at the end) but is {}", s,
           c.checkpoint.every);
  MT_CHECK(c.checkpoint.keep >= 1, "{}: checkpoint.keep must be >= 1 but is {}", s, c.checkpoint.keep);
  MT_CHECK(c.metrics.console_every >= 1, "{}: metrics.console_every must be >= 1 but is {}", s,
           c.metrics.console_every);

  const ParallelSection& p = c.parallel;
  MT_CHECK(p.pp >= 1, "{}: parallel.pp must be >= 1 but is {}", s, p.pp);
  MT_CHECK(p.ep >= 1, "{}: parallel.ep must be >= 1 but is {}", s, p.ep);
  MT_CHECK(p.cp >= 1, "{}: parallel.cp must be >= 1 but is {}", s, p.cp);
  MT_CHECK(one_of(p.sharding, {"auto", "full", "none"}), "{}: parallel.sharding must be auto, full or none but is '{}'",
           s, p.sharding);
  MT_CHECK(one_of(p.reduce_gradients, {"micro_batch", "step"}),
           "{}: parallel.reduce_gradients must be micro_batch or step but is '{}'", s, p.reduce_gradients);
  MT_CHECK(one_of(p.schedule, {"auto", "dualpipev"}), "{}: parallel.schedule must be auto or dualpipev but is '{}'", s,
           p.schedule);
  MT_CHECK(p.sharding != "full" || p.schedule == "auto",
           "{}: parallel.sharding = full (ZeRO-3) runs on the plain executor, but parallel.schedule = {} (use sharding "
           "auto or none with DualPipeV)",
           s, p.schedule);
  MT_CHECK(p.sharding != "full" || p.pp == 1,
           "{}: parallel.sharding = full (ZeRO-3) runs with parallel.pp = 1, but parallel.pp = {} (use auto or none)",
           s, p.pp);
  if (c.model.expert_weight_gradient == "step") {
    MT_CHECK(p.pp == 1 && p.schedule == "auto",
             "{}: model.expert_weight_gradient = step runs on the plain executor (parallel.pp = 1, schedule auto); "
             "found pp = {}, schedule {}",
             s, p.pp, p.schedule);
    MT_CHECK(p.sharding != "full",
             "{}: model.expert_weight_gradient = step holds every micro-batch's expert rows until the step's end, "
             "which ZeRO-3 (parallel.sharding = full) frees per layer; use micro_batch",
             s);
    MT_CHECK(!c.exact.enabled,
             "{}: model.expert_weight_gradient = step is not an exact lane (its f32 sums run in another order than "
             "the per-micro-batch gradients the byte gates pin); use micro_batch with exact.enabled",
             s);
  }
  // The layer count is not known here: partition_from_cuts checks the cuts against the model.
  if (!p.pp_cuts.empty()) {
    const size_t expected = static_cast<size_t>(2 * p.pp - 1);
    MT_CHECK(p.pp_cuts.size() == expected,
             "{}: parallel.pp_cuts has {} entries but parallel.pp = {} has {} stages and needs {} cut points (or [] "
             "for a partition balanced by cost)",
             s, p.pp_cuts.size(), p.pp, 2 * p.pp, expected);
    for (size_t i = 0; i < p.pp_cuts.size(); ++i) {
      MT_CHECK(p.pp_cuts[i] > 0, "{}: parallel.pp_cuts[{}] must be > 0 (a layer index after the first layer) but is {}",
               s, i, p.pp_cuts[i]);
      MT_CHECK(i == 0 || p.pp_cuts[i] > p.pp_cuts[i - 1],
               "{}: parallel.pp_cuts[{}] = {} is not greater than parallel.pp_cuts[{}] = {}: cuts must be strictly "
               "increasing",
               s, i, p.pp_cuts[i], i - 1, p.pp_cuts[i - 1]);
    }
  }
  MT_CHECK(c.dist.local_ranks >= 0, "{}: dist.local_ranks must be >= 0 (0: one process per rank) but is {}", s,
           c.dist.local_ranks);
  MT_CHECK(c.dist.local_ranks <= kMaxLocalRanks,
           "{}: dist.local_ranks is {}, more than the {} thread ranks one process may run (expected [0, {}])", s,
           c.dist.local_ranks, kMaxLocalRanks, kMaxLocalRanks);
  MT_CHECK(c.dist.timeout_s > 0, "{}: dist.timeout_s must be > 0 but is {}", s, c.dist.timeout_s);
  validate_eval_and_tensorboard(c, s);
}

// The code point of the UTF-8 sequence at text[i] and its length in bytes; nullopt for bytes that do not start one.
std::optional<std::pair<uint32_t, size_t>> utf8_code_point(const std::string& text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  const size_t length = lead >= 0xF0 && lead < 0xF8 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC2 && lead < 0xE0 ? 2 : 0;
  if (length == 0 || i + length > text.size()) return std::nullopt;
  uint32_t code = lead & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return std::nullopt;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  return std::pair{code, length};
}

// A TOML basic string: quotes, backslashes and control characters escaped, and every non-ASCII character written as
// a \uXXXX or \UXXXXXXXX escape (the reader refuses raw ones, see first_non_ascii). Bytes that are not UTF-8
// are written as they are, and the reader then refuses them by position.
std::string quote(const std::string& text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(static_cast<unsigned char>(ch)));
        } else if (static_cast<unsigned char>(ch) < 0x80) {
          out += ch;
        } else if (const auto point = utf8_code_point(text, i)) {
          out +=
              point->first > 0xFFFF ? fmt::format("\\U{:08X}", point->first) : fmt::format("\\u{:04X}", point->first);
          i += point->second - 1;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

// The shortest text that reads back as the same double, always a TOML float (1 -> 1.0).
std::string float_text(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";  // 'n': inf and nan
  return text;
}

void write_sources(std::string& out, const std::vector<DataSource>& sources, std::string_view sources_key) {
  for (const DataSource& d : sources) {
    out += fmt::format("\n[[{}]]\npath = {}\nweight = {}\n", sources_key, quote(d.path), float_text(d.weight));
  }
}

// The [[data.sources]] or [[eval.sources]] tables that close `section`'s keys in the written TOML.
void write_section_sources(std::string& out, std::string_view section, JobConfig& c) {
  if (section == "data") write_sources(out, c.data.sources, kSourcesKey);
  if (section == "eval") write_sources(out, c.eval.sources, kEvalSourcesKey);
}

JobConfig parse_with_base(const std::string& toml_text, const std::string& source, const fs::path& base,
                          const std::vector<std::string>& overrides) {
  toml::table root;
  if (const auto at = first_non_ascii(toml_text)) {
    MT_FAIL(
        "{}: line {}, column {}: a non-ASCII character (a job file is ASCII: write it in a string as a \\uXXXX escape)",
        source, at->first, at->second);
  }
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    MT_FAIL("{}: malformed TOML at {}: {}", source, location(e.source()), e.description());
  }
  JobConfig config;
  FileReader(source, base).read(root, config);
  for (const std::string& given : overrides) apply_override(config, given);
  validate(config, source);
  return config;
}

}  // namespace

JobConfig load_job_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  if (toml_path.empty()) return parse_with_base("", "job config (no file)", fs::current_path(), overrides);
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(toml_path, ec), "{}: job config file not found (expected a TOML file)", toml_path);
  std::ifstream in(toml_path, std::ios::binary);
  MT_CHECK(in.good(), "{}: cannot open the job config file", toml_path);
  std::ostringstream text;
  text << in.rdbuf();
  MT_CHECK(!in.bad(), "{}: reading the job config file failed", toml_path);
  return parse_with_base(text.str(), toml_path, base_folder_of(toml_path), overrides);
}

// Relative paths in `toml_text` resolve against the folder of `source` (the current directory
// when `source` names no folder), as if the text had been read from that file.
JobConfig parse_job_config(const std::string& toml_text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  return parse_with_base(toml_text, source, base_folder_of(source), overrides);
}

std::string job_config_to_toml(const JobConfig& config) {
  JobConfig copy = config;  // field_refs hands out mutable pointers; the writer only reads them
  std::string out = "# moetrain job configuration, resolved: every key, paths absolute\n";
  std::string_view section;
  for (const FieldRef& ref : field_refs(copy)) {
    if (std::holds_alternative<DataPathField>(ref.target)) continue;  // written as [[data.sources]]
    if (section_of(ref.key) != section) {
      write_section_sources(out, section, copy);
      section = section_of(ref.key);
      out += fmt::format("\n[{}]\n", section);
    }
    const std::string value =
        std::visit(Overloaded{
                       [](int64_t* p) { return fmt::format("{}", *p); },
                       [](uint64_t* p) { return fmt::format("{}", *p); },
                       [](double* p) { return float_text(*p); },
                       [](bool* p) { return std::string(*p ? "true" : "false"); },
                       [](std::string* p) { return quote(*p); },
                       [](PathField f) { return quote(*f.value); },
                       [](DataPathField) { return std::string(); },
                       [](std::vector<int64_t>* p) { return fmt::format("[{}]", fmt::join(*p, ", ")); },
                   },
                   ref.target);
    out += fmt::format("{} = {}\n", leaf_of(ref.key), value);
  }
  write_section_sources(out, section, copy);
  return out;
}

}  // namespace moetrain::io
