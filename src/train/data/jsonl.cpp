// defines: parse_jsonl_object (train/data/jsonl.h).
#include "train/data/jsonl.h"

#include "core/error.h"

namespace moetrain::train::data {

nlohmann::json parse_jsonl_object(const std::string& line, const std::string& where) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    MT_FAIL("{}: the line is not JSON ({}); expected one JSON object per line", where, e.what());
  }
  MT_CHECK(object.is_object(), "{}: the line is a JSON {} (expected a JSON object per line)", where,
           object.type_name());
  return object;
}

}  // namespace moetrain::train::data
