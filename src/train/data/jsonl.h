// defines: one line of a JSONL input (data prepare's token-id and text inputs) parsed as a JSON object, or an error
// naming the file and line.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace moetrain::train::data {

// `where` names the line ("corpus.jsonl:12") in the errors: not JSON, or JSON but not an object.
nlohmann::json parse_jsonl_object(const std::string& line, const std::string& where);

}  // namespace moetrain::train::data
