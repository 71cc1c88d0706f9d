// defines: prepare_dataset: two passes over the input (validate and count, then write), so the
// dtype can be chosen from the largest id and bad input never leaves files behind.
#include "train/data/prepare.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <span>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/data/jsonl.h"
#include "train/data/text_tokenizer.h"

namespace moetrain::train::data {

namespace fs = std::filesystem;

namespace {

enum class InputKind { kJsonlIds, kJsonlText, kText };

struct Plan {
  InputKind kind = InputKind::kJsonlIds;
  std::vector<std::string> files;
  int64_t eod = kByteEod;
  std::optional<IndexDType> dtype;  // nullopt: auto
};

// One document: its tokens (EOD included), the file and the line it started on.
using DocumentFn = std::function<void(std::span<const int64_t> tokens, const std::string& file, int64_t line)>;

Plan make_plan(const PrepareOptions& options) {
  Plan plan;
  MT_CHECK(!options.output.empty(), "data prepare: no output prefix (expected --output PREFIX)");
  const bool has_jsonl = !options.input.empty(), has_text = !options.text_files.empty();
  MT_CHECK(has_jsonl != has_text, "data prepare: {} (expected either --input FILE.jsonl or --text FILE...)",
           has_jsonl ? "--input and --text exclude each other" : "no input given");
  if (has_text) {
    plan.kind = InputKind::kText;
    plan.files = options.text_files;
  } else {
    plan.kind = options.text_field.empty() ? InputKind::kJsonlIds : InputKind::kJsonlText;
    plan.files = {options.input};
  }
  if (plan.kind == InputKind::kJsonlIds) {
    MT_CHECK(!options.field.empty(), "data prepare: --field is empty (expected the name of the token-id field)");
    MT_CHECK(options.eod.has_value(),
             "data prepare: {} holds token ids, so the end-of-document id is needed (expected "
             "--eod ID, the tokenizer's EOS/EOD token)",
             options.input);
    MT_CHECK(*options.eod >= 0 && *options.eod <= std::numeric_limits<int32_t>::max(),
             "data prepare: --eod is {} (expected a token id in [0, {}])", *options.eod,
             std::numeric_limits<int32_t>::max());
    plan.eod = *options.eod;
  } else {
    MT_CHECK(!options.eod.has_value(),
             "data prepare: --eod {} given for byte-tokenised text, which always ends "
             "documents with {} (expected no --eod)",
             options.eod.value_or(0), kByteEod);
  }
  if (options.dtype != "auto") {
    MT_CHECK(options.dtype == "uint16" || options.dtype == "int32",
             "data prepare: --dtype is \"{}\" (expected uint16 or int32)", options.dtype);
    plan.dtype = index_dtype_from_name(options.dtype);
  }
  return plan;
}

bool is_blank(std::string_view line) { return line.find_first_not_of(" \t\r\f\v") == std::string_view::npos; }

std::ifstream open_input(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  MT_CHECK(in.is_open(), "data prepare: cannot open {} (expected a readable file)", file);
  return in;
}

// Appends the ids of the JSON value `field` to `doc`; errors name file:line and the field.
void append_ids(const nlohmann::json& ids, const std::string& where, const std::string& field,
                std::vector<int64_t>& doc) {
  MT_CHECK(ids.is_array(), "{}: field \"{}\" is {} (expected an array of non-negative integer token ids)", where, field,
           ids.type_name());
  for (size_t k = 0; k < ids.size(); ++k) {
    const nlohmann::json& id = ids[k];
    MT_CHECK(id.is_number_integer(), "{}: field \"{}\"[{}] is {} {} (expected a non-negative integer token id)", where,
             field, k, id.type_name(), id.dump());
    if (id.is_number_unsigned()) {
      const auto value = id.get<uint64_t>();
      MT_CHECK(value <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max()),
               "{}: field \"{}\"[{}] is {} (expected a token id below 2^31)", where, field, k, value);
      doc.push_back(static_cast<int64_t>(value));
    } else {
      const auto value = id.get<int64_t>();
      MT_CHECK(value >= 0, "{}: field \"{}\"[{}] is the negative id {} (expected a non-negative token id)", where,
               field, k, value);
      MT_CHECK(value <= std::numeric_limits<int32_t>::max(),
               "{}: field \"{}\"[{}] is {} (expected a token id below "
               "2^31)",
               where, field, k, value);
      doc.push_back(value);
    }
  }
}

// Calls `fn` for every non-empty document of the input; returns the number of empty ones skipped.
int64_t for_each_document(const Plan& plan, const PrepareOptions& options, const DocumentFn& fn) {
  int64_t skipped = 0;
  std::vector<int64_t> doc;
  auto emit = [&](const std::string& file, int64_t line) {
    if (doc.empty()) {
      ++skipped;
      return;
    }
    doc.push_back(plan.eod);
    fn(doc, file, line);
  };
  for (const std::string& file : plan.files) {
    std::ifstream in = open_input(file);
    std::string line;
    int64_t line_no = 0;
    if (plan.kind == InputKind::kText) {
      int64_t start = 0;  // line of the paragraph's first line; 0 while outside a paragraph
      std::string paragraph;
      while (std::getline(in, line)) {
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF files give the same documents
        if (is_blank(line)) {
          if (start > 0) {
            doc.clear();
            for (char c : paragraph) doc.push_back(static_cast<unsigned char>(c));
            emit(file, start);
          }
          start = 0;
          paragraph.clear();
          continue;
        }
        if (start == 0) {
          start = line_no;
        } else {
          paragraph += '\n';
        }
        paragraph += line;
      }
      if (start > 0) {
        doc.clear();
        for (char c : paragraph) doc.push_back(static_cast<unsigned char>(c));
        emit(file, start);
      }
    } else {
      while (std::getline(in, line)) {
        ++line_no;
        if (is_blank(line)) continue;
        const std::string where = fmt::format("{}:{}", file, line_no);
        const nlohmann::json object = parse_jsonl_object(line, where);
        const std::string& field = plan.kind == InputKind::kJsonlIds ? options.field : options.text_field;
        const auto it = object.find(field);
        MT_CHECK(it != object.end(), "{}: missing field \"{}\" (expected {}; {} picks another field)", where, field,
                 plan.kind == InputKind::kJsonlIds ? "an array of token ids" : "a text string",
                 plan.kind == InputKind::kJsonlIds ? "--field" : "--text-field");
        doc.clear();
        if (plan.kind == InputKind::kJsonlIds) {
          append_ids(*it, where, field, doc);
        } else {
          MT_CHECK(it->is_string(), "{}: field \"{}\" is {} (expected a text string)", where, field, it->type_name());
          for (char c : it->get_ref<const std::string&>()) doc.push_back(static_cast<unsigned char>(c));
        }
        emit(file, line_no);
      }
    }
    MT_CHECK(!in.bad(), "data prepare: reading {} failed at line {}", file, line_no + 1);
  }
  return skipped;
}

}  // namespace

PrepareSummary prepare_dataset(const PrepareOptions& options) {
  if (!options.tokenizer.empty()) return prepare_tokenized(options);
  const Plan plan = make_plan(options);

  // Pass 1: validate everything and count; nothing is written.
  PrepareSummary summary;
  const int64_t dtype_max = plan.dtype == IndexDType::UInt16 ? 65535 : std::numeric_limits<int32_t>::max();
  summary.skipped_empty =
      for_each_document(plan, options, [&](std::span<const int64_t> tokens, const std::string& file, int64_t line) {
        for (int64_t id : tokens) {
          MT_CHECK(id <= dtype_max, "{}:{}: token id {} does not fit --dtype {} (ids up to {}); use --dtype int32",
                   file, line, id, options.dtype, dtype_max);
          summary.max_id = std::max(summary.max_id, id);
        }
        summary.documents += 1;
        summary.tokens += static_cast<int64_t>(tokens.size());
      });
  std::string inputs;
  for (const std::string& file : plan.files) inputs += (inputs.empty() ? "" : ", ") + file;
  MT_CHECK(summary.documents > 0, "data prepare: empty input: {} holds no documents{} (expected at least one)", inputs,
           summary.skipped_empty > 0 ? fmt::format(" ({} empty ones skipped)", summary.skipped_empty) : "");
  summary.dtype = plan.dtype.value_or(index_dtype_for_max_id(summary.max_id));

  // Pass 2: write.
  const fs::path parent = fs::path(options.output).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    MT_CHECK(!ec, "data prepare: cannot create the output folder {}: {}", parent.string(), ec.message());
  }
  IndexedDatasetBuilder builder(options.output, summary.dtype);
  for_each_document(plan, options, [&](std::span<const int64_t> tokens, const std::string&, int64_t) {
    builder.add_sequence(tokens);
  });
  MT_CHECK(builder.num_sequences() == summary.documents && builder.num_tokens() == summary.tokens,
           "data prepare: {} changed while it was read ({} documents / {} tokens, then {} / {})", inputs,
           summary.documents, summary.tokens, builder.num_sequences(), builder.num_tokens());
  builder.finish();
  summary.idx_path = options.output + ".idx";
  summary.bin_path = options.output + ".bin";
  return summary;
}

}  // namespace moetrain::train::data
