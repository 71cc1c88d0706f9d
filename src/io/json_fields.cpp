// defines: the typed JSON field reads and the bounded JSON file reader of json_fields.h.
#include "io/json_fields.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "core/error.h"

namespace moetrain::io {

using nlohmann::json;

std::string json_found_str(const json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return fmt::format("{} ({})", value.type_name(), text);
}

JsonFields::JsonFields(const json& object, std::string source, std::string where)
    : object_(object), source_(std::move(source)), where_(std::move(where)) {}

bool JsonFields::has(const char* name) const {
  const auto it = object_.find(name);
  return it != object_.end() && !it->is_null();
}

std::optional<int64_t> JsonFields::int_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_number_integer(), "{}: field '{}{}' must be an integer but found {}", source_, where_, name,
           json_found_str(v));
  MT_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
           "{}: field '{}{}' is too large ({})", source_, where_, name, v.dump());
  return v.get<int64_t>();
}

std::optional<double> JsonFields::number_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_number(), "{}: field '{}{}' must be a number but found {}", source_, where_, name, json_found_str(v));
  return v.get<double>();
}

std::optional<bool> JsonFields::bool_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_boolean(), "{}: field '{}{}' must be true or false but found {}", source_, where_, name,
           json_found_str(v));
  return v.get<bool>();
}

std::optional<std::string> JsonFields::string_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_string(), "{}: field '{}{}' must be a string but found {}", source_, where_, name, json_found_str(v));
  return v.get<std::string>();
}

std::optional<std::vector<int64_t>> JsonFields::int_list_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_array(), "{}: field '{}{}' must be a list of integers but found {}", source_, where_, name,
           json_found_str(v));
  std::vector<int64_t> out;
  for (const json& e : v) {
    MT_CHECK(e.is_number_integer(), "{}: field '{}{}' must be a list of integers but holds {}", source_, where_, name,
             json_found_str(e));
    out.push_back(e.get<int64_t>());
  }
  return out;
}

std::optional<std::vector<std::string>> JsonFields::string_list_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_array(), "{}: field '{}{}' must be a list of strings but found {}", source_, where_, name,
           json_found_str(v));
  std::vector<std::string> out;
  for (const json& e : v) {
    MT_CHECK(e.is_string(), "{}: field '{}{}' must be a list of strings but holds {}", source_, where_, name,
             json_found_str(e));
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::optional<JsonFields> JsonFields::object_opt(const char* name) const {
  if (!has(name)) return std::nullopt;
  const json& v = object_.at(name);
  MT_CHECK(v.is_object(), "{}: field '{}{}' must be null or an object but found {}", source_, where_, name,
           json_found_str(v));
  return JsonFields(v, source_, where_ + name + ".");
}

void JsonFields::require_present(const char* name) const {
  const auto it = object_.find(name);
  MT_CHECK(it != object_.end(), "{}: required field '{}{}' is missing", source_, where_, name);
  MT_CHECK(!it->is_null(), "{}: required field '{}{}' is null", source_, where_, name);
}

int64_t JsonFields::require_int(const char* name) const {
  require_present(name);
  return *int_opt(name);
}

double JsonFields::require_number(const char* name) const {
  require_present(name);
  return *number_opt(name);
}

std::string JsonFields::require_string(const char* name) const {
  require_present(name);
  return *string_opt(name);
}

void JsonFields::check_positive(int64_t value, const char* name, int64_t max) const {
  MT_CHECK(value > 0, "{}: {}{} must be positive but is {}", source_, where_, name, value);
  MT_CHECK(value <= max, "{}: {}{} is {}, more than the {} the engine accepts (a corrupt or mistyped value?)", source_,
           where_, name, value, max);
}

void JsonFields::check_range(int64_t value, const char* name, int64_t min, int64_t max) const {
  MT_CHECK(min <= value && value <= max, "{}: {}{} is {}, expected a value in [{}, {}]", source_, where_, name, value,
           min, max);
}

json parse_json_object(const std::string& text, const std::string& source) {
  // The parser reads a NUL as the end of its input, so bytes after one would pass unseen.
  const size_t nul = text.find('\0');
  MT_CHECK(nul == std::string::npos, "{}: not valid JSON: a NUL byte at byte {} (a JSON text holds none)", source, nul);
  json root;
  try {
    // The whole text must be one document: strict parsing refuses anything after it.
    root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    MT_FAIL("{}: not valid JSON at byte {}: {}", source, e.byte, e.what());
  } catch (const json::exception& e) {
    MT_FAIL("{}: not valid JSON: {}", source, e.what());
  }
  MT_CHECK(root.is_object(), "{}: expected a JSON object at the top level but found {}", source, json_found_str(root));
  return root;
}

std::string read_bounded_file(const std::string& path, int64_t max_bytes) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  MT_CHECK(!ec && std::filesystem::exists(status), "{}: cannot read: the file does not exist", path);
  MT_CHECK(std::filesystem::is_regular_file(status), "{}: expected a regular file but found {}", path,
           std::filesystem::is_directory(status) ? "a directory" : "another kind of file (a FIFO, socket or device)");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  MT_CHECK(!ec, "{}: cannot read its size: {}", path, ec.message());
  MT_CHECK(size <= static_cast<uintmax_t>(max_bytes), "{}: {} bytes is more than the {} bytes such a file may have",
           path, size, max_bytes);
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "{}: cannot open", path);
  std::ostringstream text;
  text << in.rdbuf();
  MT_CHECK(!in.bad(), "{}: read failed", path);
  return text.str();
}

json read_json_object(const std::string& path, int64_t max_bytes) {
  return parse_json_object(read_bounded_file(path, max_bytes), path);
}

}  // namespace moetrain::io
