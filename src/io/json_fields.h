// defines: JsonFields, typed reads of one JSON object's fields that name the file and the field when a value is
// missing or of the wrong type, and read_json_object, which reads a JSON file (a regular file, bounded in size, no
// bytes after the document) into an object. Every config parser of the engine reads through these, so a malformed
// file gives the same clear error wherever it is read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetrain::io {

// The largest value a config may give one size (a dimension, a count of heads, a vocabulary): 2^24, far above every
// released model's (vocabularies reach 2^18), and small enough that a product of three of them fits in int64.
inline constexpr int64_t kMaxConfigExtent = int64_t{1} << 24;

// "object ({...})" with the text cut to 40 characters: how an error shows a value it did not expect.
std::string json_found_str(const nlohmann::json& value);

class JsonFields {
 public:
  // `where` names the object inside the file ("" for the top level, "rope_parameters." for a nested one). A null
  // value counts as absent. The object must outlive the reader.
  JsonFields(const nlohmann::json& object, std::string source, std::string where = "");

  const std::string& source() const { return source_; }
  bool has(const char* name) const;
  const nlohmann::json& at(const char* name) const { return object_.at(name); }

  std::optional<int64_t> int_opt(const char* name) const;
  std::optional<double> number_opt(const char* name) const;
  std::optional<bool> bool_opt(const char* name) const;
  std::optional<std::string> string_opt(const char* name) const;
  std::optional<std::vector<int64_t>> int_list_opt(const char* name) const;
  std::optional<std::vector<std::string>> string_list_opt(const char* name) const;
  // A nested object's reader (absent or null: nullopt); a value of another type is an error.
  std::optional<JsonFields> object_opt(const char* name) const;

  int64_t require_int(const char* name) const;
  double require_number(const char* name) const;
  std::string require_string(const char* name) const;

  // Fails with "<source>: <where><name> must be positive but is <value>", or with "... is more than the <max> ..."
  // when it exceeds `max` (every size a config gives is bounded before anything is allocated from it).
  void check_positive(int64_t value, const char* name, int64_t max = kMaxConfigExtent) const;
  // Fails unless min <= value <= max, naming the field and the range.
  void check_range(int64_t value, const char* name, int64_t min, int64_t max) const;

 private:
  void require_present(const char* name) const;

  const nlohmann::json& object_;
  std::string source_;
  std::string where_;
};

// Parses `text` as one JSON object; `source` names it in errors. Bytes after the document (a NUL and garbage
// included) and a top level that is not an object are errors.
nlohmann::json parse_json_object(const std::string& text, const std::string& source);

// Reads a whole file as bytes: refused, before it is opened, when it is not a regular file (a FIFO would block the
// open forever, a device has no end) or larger than `max_bytes`. Errors name the path.
std::string read_bounded_file(const std::string& path, int64_t max_bytes);

// Reads a JSON object from a file: refused when it is not a regular file (a FIFO, a device) or larger than
// `max_bytes`, before anything is read.
nlohmann::json read_json_object(const std::string& path, int64_t max_bytes = int64_t{64} << 20);

}  // namespace moetrain::io
