// defines: the safetensors reader (header parsing and validation, views into the mapping, sharded
// sets through an index) and the atomic single-file and sharded writers.
#include "io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/json_fields.h"

namespace moetrain::io {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The bound Hugging Face's reader puts on the header, so a corrupt length cannot ask for gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

std::string known_dtype_names() {
  std::string names;
  for (DType d : {DType::F64, DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U64, DType::U32, DType::U16, DType::U8, DType::Bool}) {
    if (!names.empty()) names += ", ";
    names += dtype_safetensors_name(d);
  }
  return names;
}

// Builds JSON values from SAX events, refusing a key that repeats in its object (nlohmann's DOM keeps the last of
// two equal keys silently; its callback parser would see them, but takes time quadratic in the member count). The
// members of the top-level object are handed to `on_member` one at a time when it is set (a safetensors header of a
// million tensors is never held whole), else kept in `root`. Each insertion costs O(log members): linear time overall
// up to that factor. Errors start with `what`.
class UniqueKeyParser {
 public:
  using Member = std::function<void(std::string& key, json& value)>;
  UniqueKeyParser(std::string what, Member on_member) : what_(std::move(what)), on_member_(std::move(on_member)) {}

  json root;

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const std::string&) { return put(json(v)); }
  bool string(std::string& v) { return put(json(std::move(v))); }
  bool binary(json::binary_t& v) { return put(json(std::move(v))); }
  bool start_object(std::size_t) {
    if (!started_) {
      started_ = true;
      root = json::object();
      return true;
    }
    return put(json::object());
  }
  bool start_array(std::size_t) {
    MT_CHECK(started_, "{} is a JSON array, expected an object", what_);
    return put(json::array());
  }
  bool key(std::string& k) {
    if (stack_.empty()) {
      member_key_ = k;
      // Streamed members are not kept: their caller finds a repeated name (parse_safetensors_header, after sorting).
      if (!on_member_) MT_CHECK(!root.contains(k), "{} has key '{}' twice", what_, k);
    } else {
      MT_CHECK(!stack_.back()->contains(k), "{} has key '{}' twice in the entry of '{}' (duplicate names)", what_, k,
               member_key_);
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) {
    MT_FAIL("{} is not valid JSON at byte {}: {}", what_, position, e.what());
  }

 private:
  bool put(json&& value) {
    MT_CHECK(started_, "{} is a JSON {}, expected an object", what_, value.type_name());
    const bool container = value.is_object() || value.is_array();
    json* placed = nullptr;
    if (stack_.empty()) {
      if (on_member_) {
        member_ = std::move(value);
        placed = &member_;
      } else {
        placed = &(root[member_key_] = std::move(value));
      }
    } else if (stack_.back()->is_array()) {
      stack_.back()->push_back(std::move(value));
      placed = &stack_.back()->back();
    } else {
      placed = &((*stack_.back())[key_] = std::move(value));
    }
    if (container) {
      stack_.push_back(placed);
    } else if (stack_.empty()) {
      finish_member();
    }
    return true;
  }
  bool close() {
    if (stack_.empty()) return true;  // the top-level object
    stack_.pop_back();
    if (stack_.empty()) finish_member();
    return true;
  }
  void finish_member() {
    if (!on_member_) return;
    on_member_(member_key_, member_);
    member_ = json();
  }

  std::string what_;
  Member on_member_;
  bool started_ = false;
  std::vector<json*> stack_;  // the open containers below the top level, innermost last
  std::string member_key_;    // the current top-level key
  std::string key_;           // the last key read
  json member_;
};

// A NUL byte is refused before any parse: what follows it would otherwise pass unseen.
void refuse_nul(std::string_view text, const std::string& what) {
  const size_t nul = text.find('\0');
  MT_CHECK(nul == std::string_view::npos, "{}: a NUL byte at byte {} (JSON holds none; padding is spaces)", what, nul);
}

// Parses `text` as one JSON object whose keys are unique at every level; throws moetrain::Error starting with
// `what` when it is not.
void parse_unique_json(std::string_view text, UniqueKeyParser& parser, const std::string& what) {
  refuse_nul(text, what);
  try {
    json::sax_parse(text.begin(), text.end(), &parser, json::input_format_t::json, /*strict=*/true);
  } catch (const json::exception& e) {
    MT_FAIL("{} is not valid JSON: {}", what, e.what());
  }
}

json parse_json(std::string_view text, const std::string& what) {
  UniqueKeyParser parser(what, nullptr);
  parse_unique_json(text, parser, what);
  return std::move(parser.root);
}

uint64_t checked_span_bytes(const Shape& shape, DType dtype, bool* overflow) {
  uint64_t bytes = dtype_size(dtype);
  *overflow = false;
  for (int64_t extent : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes)) *overflow = true;
  }
  return bytes;
}

DType known_dtype(const std::string& name, const std::string& dtype_name, const std::string& path) {
  DType dtype = DType::F32;
  MT_CHECK(dtype_from_safetensors_name(dtype_name, &dtype),
           "safetensors: tensor '{}' in {} has unknown dtype '{}' (expected one of {})", name, path, dtype_name,
           known_dtype_names());
  return dtype;
}

// The checks of an entry whose fields have their JSON types: offsets in order, spanning what the shape needs.
void check_entry_span(const SafetensorsEntry& entry, const std::string& dtype_name, const std::string& path) {
  const std::string& name = entry.name;
  MT_CHECK(entry.begin <= entry.end,
           "safetensors: tensor '{}' in {}: data_offsets [{}, {}] begin after they end (expected begin <= end)", name,
           path, entry.begin, entry.end);

  bool overflow = false;
  const uint64_t expected = checked_span_bytes(entry.shape, entry.dtype, &overflow);
  MT_CHECK(!overflow, "safetensors: tensor '{}' in {}: shape {} x {} overflows 64 bits of bytes", name, path,
           shape_str(entry.shape), dtype_name);
  MT_CHECK(entry.end - entry.begin == expected,
           "safetensors: tensor '{}' in {} spans {} bytes (data_offsets [{}, {}]) but shape {} x {} ({} bytes each) "
           "needs {} bytes",
           name, path, entry.end - entry.begin, entry.begin, entry.end, shape_str(entry.shape), dtype_name,
           dtype_size(entry.dtype), expected);
}

SafetensorsEntry parse_entry(const std::string& name, const json& value, const std::string& path) {
  MT_CHECK(value.is_object(),
           "safetensors: tensor '{}' in {}: entry is a JSON {}, expected an object with dtype, shape and "
           "data_offsets",
           name, path, value.type_name());
  SafetensorsEntry entry;
  entry.name = name;

  const auto dtype_it = value.find("dtype");
  MT_CHECK(dtype_it != value.end(), "safetensors: tensor '{}' in {} has no 'dtype'", name, path);
  MT_CHECK(dtype_it->is_string(), "safetensors: tensor '{}' in {}: dtype is a JSON {}, expected a string", name, path,
           dtype_it->type_name());
  const auto& dtype_name = dtype_it->get_ref<const std::string&>();
  entry.dtype = known_dtype(name, dtype_name, path);

  const auto shape_it = value.find("shape");
  MT_CHECK(shape_it != value.end(), "safetensors: tensor '{}' in {} has no 'shape'", name, path);
  MT_CHECK(shape_it->is_array(), "safetensors: tensor '{}' in {}: shape is a JSON {}, expected an array", name, path,
           shape_it->type_name());
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& extent = (*shape_it)[i];
    MT_CHECK(extent.is_number_unsigned() &&
                 extent.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
             "safetensors: tensor '{}' in {}: shape entry {} is {}, expected a non-negative integer", name, path, i,
             extent.dump());
    entry.shape.push_back(extent.get<int64_t>());
  }

  const auto offsets_it = value.find("data_offsets");
  MT_CHECK(offsets_it != value.end(), "safetensors: tensor '{}' in {} has no 'data_offsets'", name, path);
  const json& offsets = *offsets_it;
  MT_CHECK(
      offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
      "safetensors: tensor '{}' in {}: data_offsets is {}, expected two non-negative integers [begin, end]", name, path,
      offsets.dump());
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  check_entry_span(entry, dtype_name, path);
  return entry;
}

std::map<std::string, std::string> parse_metadata(const json& value, const std::string& path) {
  MT_CHECK(value.is_object(), "safetensors: {} in {} is a JSON {}, expected an object of strings", kMetadataKey, path,
           value.type_name());
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    MT_CHECK(item.is_string(), "safetensors: {} in {}: key '{}' holds a JSON {}, expected a string", kMetadataKey, path,
             key, item.type_name());
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// Reads a header in the one shape the safetensors format allows (an object of entries {"dtype": string, "shape":
// [unsigned...], "data_offsets": [unsigned, unsigned]}, each key once, and a __metadata__ object of strings) straight
// into the entries, without a JSON value per entry: a million-tensor header in well under a second. At anything else
// (another key, another type, a repeated key, a syntax error) it stops and answers false, and the caller parses the
// text again with UniqueKeyParser, whose errors it keeps. An error this reader raises itself (an unknown dtype,
// offsets that disagree with the shape) comes from the first entry that has it, where every earlier entry had the
// allowed shape and passed: the same error, from the same entry, that the general parser raises.
class WellFormedHeaderReader {
 public:
  WellFormedHeaderReader(const std::string& path, std::vector<SafetensorsEntry>& entries,
                         std::map<std::string, std::string>& metadata, int& metadata_members)
      : path_(path), entries_(entries), metadata_(metadata), metadata_members_(metadata_members) {}

  bool null() { return false; }
  bool boolean(bool) { return false; }
  bool number_integer(json::number_integer_t) { return false; }
  bool number_float(json::number_float_t, const std::string&) { return false; }
  bool binary(json::binary_t&) { return false; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }

  bool number_unsigned(json::number_unsigned_t v) {
    if (at_ == At::Shape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
      shape_.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (at_ == At::Offsets && offsets_read_ < 2) {
      offsets_[offsets_read_++] = v;
      return true;
    }
    return false;
  }
  bool string(std::string& v) {
    if (at_ == At::Metadata) return metadata_.emplace(std::move(metadata_key_), std::move(v)).second;
    if (at_ != At::Entry || field_ != Field::Dtype) return false;
    dtype_name_ = v;
    return true;
  }
  bool start_object(std::size_t) {
    if (at_ == At::Start) {
      at_ = At::Root;
      return true;
    }
    if (at_ != At::Root) return false;
    if (member_name_ == kMetadataKey) {
      ++metadata_members_;
      metadata_.clear();
      at_ = At::Metadata;
    } else {
      seen_ = 0;
      at_ = At::Entry;
    }
    return true;
  }
  bool start_array(std::size_t) {
    if (at_ != At::Entry) return false;
    if (field_ == Field::Shape) {
      shape_.clear();
      at_ = At::Shape;
      return true;
    }
    if (field_ == Field::Offsets) {
      offsets_read_ = 0;
      at_ = At::Offsets;
      return true;
    }
    return false;
  }
  bool key(std::string& k) {
    switch (at_) {
      case At::Root: member_name_ = std::move(k); return true;
      case At::Metadata: metadata_key_ = std::move(k); return true;
      case At::Entry:
        field_ = k == "dtype"          ? Field::Dtype
                 : k == "shape"        ? Field::Shape
                 : k == "data_offsets" ? Field::Offsets
                                       : Field::Other;
        if (field_ == Field::Other || (seen_ & bit(field_)) != 0) return false;
        seen_ |= bit(field_);
        return true;
      default: return false;
    }
  }
  bool end_array() {
    if (at_ == At::Offsets && offsets_read_ != 2) return false;
    if (at_ != At::Shape && at_ != At::Offsets) return false;
    at_ = At::Entry;
    return true;
  }
  bool end_object() {
    switch (at_) {
      case At::Root: at_ = At::Done; return true;
      case At::Metadata: at_ = At::Root; return true;
      case At::Entry:
        if (seen_ != (bit(Field::Dtype) | bit(Field::Shape) | bit(Field::Offsets))) return false;
        finish_entry();
        at_ = At::Root;
        return true;
      default: return false;
    }
  }

 private:
  enum class At { Start, Root, Metadata, Entry, Shape, Offsets, Done };
  enum class Field { Dtype, Shape, Offsets, Other };
  static unsigned bit(Field f) { return 1u << static_cast<unsigned>(f); }

  void finish_entry() {
    SafetensorsEntry& entry = entries_.emplace_back();
    entry.name = std::move(member_name_);
    entry.dtype = known_dtype(entry.name, dtype_name_, path_);
    entry.shape.assign(shape_.begin(), shape_.end());
    entry.begin = offsets_[0];
    entry.end = offsets_[1];
    check_entry_span(entry, dtype_name_, path_);
  }

  const std::string& path_;
  std::vector<SafetensorsEntry>& entries_;
  std::map<std::string, std::string>& metadata_;
  int& metadata_members_;
  At at_ = At::Start;
  Field field_ = Field::Other;
  unsigned seen_ = 0;  // the entry's fields read so far, one bit each
  std::string member_name_;
  std::string metadata_key_;
  std::string dtype_name_;
  Shape shape_;
  uint64_t offsets_[2] = {0, 0};
  int offsets_read_ = 0;
};

// Reads `text` with WellFormedHeaderReader; false when the text is anything but a well-formed header (the caller
// then parses it again with the general parser, clearing what this filled).
bool read_well_formed_header(std::string_view text, const std::string& path, std::vector<SafetensorsEntry>& entries,
                             std::map<std::string, std::string>& metadata, int& metadata_members) {
  WellFormedHeaderReader reader(path, entries, metadata, metadata_members);
  try {
    return json::sax_parse(text.begin(), text.end(), &reader, json::input_format_t::json, /*strict=*/true);
  } catch (const json::exception&) {
    return false;
  }
}

// Tensors must tile the data section exactly: sorted by offset, each begins where the previous ends
// and the last ends at the section's end.
void check_layout(std::vector<const SafetensorsEntry*> entries, uint64_t data_size, const std::string& path) {
  for (const SafetensorsEntry* e : entries) {
    MT_CHECK(e->end <= data_size, "safetensors: tensor '{}' in {} ends at byte {} but the data section has {}", e->name,
             path, e->end, data_size);
  }
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry* e : entries) {
    MT_CHECK(e->begin >= covered,
             "safetensors: tensors '{}' and '{}' in {} overlap: '{}' begins at byte {} but '{}' ends at byte {}",
             previous->name, e->name, path, e->name, e->begin, previous->name, covered);
    MT_CHECK(e->begin == covered,
             "safetensors: {} has a hole: bytes [{}, {}) of the data section, {} tensor '{}', belong to no tensor",
             path, covered, e->begin, previous ? fmt::format("between tensor '{}' and", previous->name) : "before",
             e->name);
    covered = e->end;
    previous = e;
  }
  MT_CHECK(covered == data_size,
           "safetensors: {} has a hole: bytes [{}, {}) at the end of the data section{} belong to no tensor", path,
           covered, data_size, previous ? fmt::format(", after tensor '{}',", previous->name) : "");
}

bool ends_with(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ---- writing ----

void validate_for_writing(const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& what) {
  std::set<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    MT_CHECK(!name.empty(), "safetensors: writing {}: a tensor has an empty name", what);
    MT_CHECK(name != kMetadataKey, "safetensors: writing {}: '{}' is reserved for the metadata, not a tensor name",
             what, name);
    MT_CHECK(names.insert(name).second,
             "safetensors: writing {}: tensor name '{}' appears twice (names must be unique)", what, name);
    MT_CHECK(tensor.defined(), "safetensors: writing {}: tensor '{}' is undefined", what, name);
    MT_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
             "safetensors: writing {}: tensor '{}' is {}{}, expected a contiguous CPU tensor", what, name,
             tensor.describe(), tensor.is_contiguous() ? "" : " (not contiguous)");
  }
}

std::string build_header(const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata, const std::string& what) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t bytes = tensor.nbytes();
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(dtype_safetensors_name(tensor.dtype()));
    entry["shape"] = tensor.shape();
    entry["data_offsets"] = nlohmann::ordered_json::array({offset, offset + bytes});
    header[name] = std::move(entry);
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    MT_FAIL("safetensors: writing {}: cannot encode the header (names and metadata must be UTF-8): {}", what, e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

using Chunk = std::pair<const void*, size_t>;

// Writes one file of already validated tensors.
void write_validated(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                     const std::map<std::string, std::string>& metadata) {
  const std::string header = build_header(tensors, metadata, path);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t(header.size()) >> (8 * i));
  std::vector<Chunk> chunks = {{length, sizeof(length)}, {header.data(), header.size()}};
  for (const auto& [name, tensor] : tensors) {
    if (tensor.nbytes() > 0) chunks.push_back({tensor.raw_data(), tensor.nbytes()});
  }
  write_file_atomically(path, chunks, "safetensors");
}

}  // namespace

// ---- SafetensorsFile ----

SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t data_size, const std::string& path) {
  const std::string what = fmt::format("safetensors: header of {}", path);
  SafetensorsHeader header;
  std::vector<SafetensorsEntry> entries;
  int metadata_members = 0;
  refuse_nul(text, what);
  if (!read_well_formed_header(text, path, entries, header.metadata, metadata_members)) {
    entries.clear();
    header.metadata.clear();
    metadata_members = 0;
    UniqueKeyParser parser(what, [&](std::string& name, json& value) {
      if (name == kMetadataKey) {
        ++metadata_members;
        header.metadata = parse_metadata(value, path);
      } else {
        entries.push_back(parse_entry(name, value, path));
      }
    });
    parse_unique_json(text, parser, what);
  }
  MT_CHECK(metadata_members <= 1, "{} names tensor '{}' twice (duplicate names)", what, kMetadataKey);
  // Sorted by name, a repeated name sits next to itself: one sort serves both the check and the map.
  // Writers list the tensors sorted (safetensors' own writers do): then the sort is a check. Otherwise a stable sort,
  // whose merges stay O(n log n) on nearly sorted input, where std::sort's introsort fell back to a heap sort. It
  // sorts pointers: moving a million entries (a name, a shape) through the merges took most of a refusal's 2 s.
  std::vector<SafetensorsEntry*> by_name_order;
  by_name_order.reserve(entries.size());
  for (SafetensorsEntry& entry : entries) by_name_order.push_back(&entry);
  const auto by_name = [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->name < b->name; };
  if (!std::is_sorted(by_name_order.begin(), by_name_order.end(), by_name))
    std::stable_sort(by_name_order.begin(), by_name_order.end(), by_name);
  const auto repeated =
      std::adjacent_find(by_name_order.begin(), by_name_order.end(),
                         [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->name == b->name; });
  MT_CHECK(repeated == by_name_order.end(), "{} names tensor '{}' twice (duplicate names)", what,
           repeated == by_name_order.end() ? std::string() : (*repeated)->name);
  for (SafetensorsEntry* entry : by_name_order) {
    std::string name = entry->name;
    header.entries.emplace_hint(header.entries.end(), std::move(name), std::move(*entry));
  }
  std::vector<const SafetensorsEntry*> layout;
  layout.reserve(header.entries.size());
  for (const auto& [name, entry] : header.entries) layout.push_back(&entry);
  check_layout(std::move(layout), data_size, path);
  return header;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  file.file_ = MappedFile::open(path);
  const uint8_t* bytes = file.file_->data();
  const uint64_t size = file.file_->size();
  MT_CHECK(size >= 8, "safetensors: {} has {} bytes, fewer than the 8-byte header length (truncated?)", path, size);

  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t(bytes[i]) << (8 * i);
  MT_CHECK(header_bytes <= kMaxHeaderBytes,
           "safetensors: {} declares a header of {} bytes, more than the limit of {} bytes (corrupt or not a "
           "safetensors file)",
           path, header_bytes, kMaxHeaderBytes);
  MT_CHECK(header_bytes <= size - 8,
           "safetensors: {} declares a header of {} bytes but the file has only {} bytes after the length field "
           "(truncated or not a safetensors file)",
           path, header_bytes, size - 8);
  file.data_start_ = 8 + header_bytes;
  const uint64_t data_size = size - file.data_start_;

  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_bytes);
  SafetensorsHeader header = parse_safetensors_header(text, data_size, path);
  file.entries_ = std::move(header.entries);
  file.metadata_ = std::move(header.metadata);
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  MT_CHECK(it != entries_.end(), "safetensors: no tensor '{}' in {} (it holds {} tensor{})", name, path_,
           entries_.size(), entries_.size() == 1 ? "" : "s");
  return it->second;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const uint8_t* data = file_->data() + data_start_ + e.begin;
  if (reinterpret_cast<uintptr_t>(data) % dtype_size(e.dtype) == 0) {
    // The mapping is read-only; from_blob takes a mutable pointer because Tensor has no const view.
    return Tensor::from_blob(const_cast<uint8_t*>(data), e.shape, e.dtype, Device::cpu(), file_);
  }
  Tensor copy = Tensor::empty(e.shape, e.dtype);
  if (e.end > e.begin) std::memcpy(copy.raw_data(), data, e.end - e.begin);
  return copy;
}

// ---- SafetensorsReader ----

std::map<std::string, std::string> parse_safetensors_index(std::string_view text, const std::string& path) {
  const std::string what = fmt::format("safetensors index {}", path);
  const json index = parse_json(text, what);
  const auto map_it = index.find("weight_map");
  MT_CHECK(map_it != index.end() && map_it->is_object(), "{} has no 'weight_map' object (found {})", what,
           map_it == index.end() ? std::string("none") : std::string("a JSON ") + map_it->type_name());
  MT_CHECK(!map_it->empty(), "{}: weight_map names no tensors", what);

  const fs::path folder = fs::path(path).parent_path();
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, shard] : map_it->items()) {
    MT_CHECK(shard.is_string() && !shard.get_ref<const std::string&>().empty(),
             "{}: weight_map entry of tensor '{}' is {}, expected a shard file name", what, name, shard.dump());
    // Shards live in the model folder: an absolute path or a '..' would load weights from anywhere.
    const fs::path relative(shard.get<std::string>());
    MT_CHECK(relative.is_relative() &&
                 std::none_of(relative.begin(), relative.end(), [](const fs::path& part) { return part == ".."; }),
             "{}: weight_map entry of tensor '{}' is '{}', expected a file inside the model folder (no absolute "
             "path, no '..')",
             what, name, relative.string());
    weight_map.emplace(name, (folder / relative).string());
  }
  return weight_map;
}

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader reader;
  reader.path_ = path;
  std::error_code error;
  std::string index_path;
  if (fs::is_directory(path, error)) {
    const std::string single = (fs::path(path) / kSingleFileName).string();
    const std::string index = (fs::path(path) / kIndexFileName).string();
    const bool has_single = fs::exists(single, error);
    const bool has_index = fs::exists(index, error);
    MT_CHECK(!(has_single && has_index), "safetensors: folder {} holds both {} and {}; one of them is stale, remove it",
             path, kSingleFileName, kIndexFileName);
    MT_CHECK(has_single || has_index, "safetensors: folder {} holds neither {} nor {}", path, kSingleFileName,
             kIndexFileName);
    if (has_single) {
      reader.files_.push_back(SafetensorsFile::open(single));
    } else {
      index_path = index;
    }
  } else if (ends_with(path, ".json")) {
    index_path = path;
  } else {
    reader.files_.push_back(SafetensorsFile::open(path));
  }

  if (index_path.empty()) {
    for (const std::string& name : reader.files_[0].names()) reader.file_of_.emplace(name, 0);
    return reader;
  }

  // A sharded set: the index's weight_map must agree exactly with what the shards hold.
  const std::string what = fmt::format("safetensors index {}", index_path);
  const std::map<std::string, std::string> weight_map =  // tensor -> shard path
      parse_safetensors_index(read_bounded_file(index_path, kMaxHeaderBytes), index_path);
  std::map<std::string, std::string> shards;  // shard path -> first tensor assigned to it
  for (const auto& [name, shard_path] : weight_map) shards.emplace(shard_path, name);
  for (const auto& [shard_path, first_tensor] : shards) {
    MT_CHECK(fs::is_regular_file(shard_path, error), "{}: shard {} (of tensor '{}') does not exist", what, shard_path,
             first_tensor);
    reader.files_.push_back(SafetensorsFile::open(shard_path));
    const size_t index_of_file = reader.files_.size() - 1;
    for (const std::string& name : reader.files_.back().names()) {
      const auto [it, inserted] = reader.file_of_.emplace(name, index_of_file);
      MT_CHECK(inserted, "{}: tensor '{}' appears in two shards, {} and {}", what, name,
               reader.files_[it->second].path(), shard_path);
    }
  }
  for (const auto& [name, shard_path] : weight_map) {
    const auto it = reader.file_of_.find(name);
    MT_CHECK(it != reader.file_of_.end() && reader.files_[it->second].path() == shard_path,
             "{} assigns tensor '{}' to shard {} but that shard does not contain it{}", what, name, shard_path,
             it == reader.file_of_.end() ? std::string(" (no shard does)")
                                         : fmt::format(" (it is in {})", reader.files_[it->second].path()));
  }
  for (const auto& [name, file_index] : reader.file_of_) {
    MT_CHECK(weight_map.count(name) != 0, "{}: shard {} holds tensor '{}' that the index does not list", what,
             reader.files_[file_index].path(), name);
  }
  return reader;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> names;
  names.reserve(file_of_.size());
  for (const auto& [name, file_index] : file_of_) names.push_back(name);
  return names;
}

const SafetensorsFile& SafetensorsReader::file_for(const std::string& name) const {
  const auto it = file_of_.find(name);
  MT_CHECK(it != file_of_.end(), "safetensors: no tensor '{}' in {} ({} tensors in {} file{})", name, path_,
           file_of_.size(), files_.size(), files_.size() == 1 ? "" : "s");
  return files_[it->second];
}

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const { return file_for(name).entry(name); }
Tensor SafetensorsReader::tensor(const std::string& name) const { return file_for(name).tensor(name); }
std::string SafetensorsReader::file_of(const std::string& name) const { return file_for(name).path(); }

// ---- writers ----

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  validate_for_writing(tensors, path);
  write_validated(path, tensors, metadata);
}

std::vector<std::string> write_safetensors_sharded(const std::string& dir, const std::string& stem,
                                                   const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                   uint64_t max_shard_bytes,
                                                   const std::map<std::string, std::string>& metadata) {
  MT_CHECK(!stem.empty() && stem.find('/') == std::string::npos,
           "safetensors: sharded write to {}: stem '{}' must be a non-empty file name without '/'", dir, stem);
  validate_for_writing(tensors, fmt::format("{}/{}", dir, stem));

  // Greedy in the given order: a shard closes when the next tensor would push it past the limit.
  std::vector<std::vector<std::pair<std::string, Tensor>>> groups;
  uint64_t group_bytes = 0;
  uint64_t total_bytes = 0;
  for (const auto& item : tensors) {
    const uint64_t bytes = item.second.nbytes();
    if (groups.empty() || (!groups.back().empty() && group_bytes + bytes > max_shard_bytes)) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(item);
    group_bytes += bytes;
    total_bytes += bytes;
  }

  std::error_code error;
  fs::create_directories(dir, error);
  MT_CHECK(!error, "safetensors: cannot create folder {}: {}", dir, error.message());

  if (groups.size() <= 1) {
    const std::string path = (fs::path(dir) / (stem + ".safetensors")).string();
    write_validated(path, tensors, metadata);
    return {path};
  }

  std::vector<std::string> written;
  json weight_map = json::object();
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string file_name = fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem, i + 1, groups.size());
    const std::string path = (fs::path(dir) / file_name).string();
    write_validated(path, groups[i], metadata);
    written.push_back(path);
    for (const auto& [name, tensor] : groups[i]) weight_map[name] = file_name;
  }
  json index = json::object();
  index["metadata"] = json::object({{"total_size", total_bytes}});
  index["weight_map"] = std::move(weight_map);
  const std::string text = index.dump(2) + "\n";
  const std::string index_path = (fs::path(dir) / (stem + ".safetensors.index.json")).string();
  write_file_atomically(index_path, {{text.data(), text.size()}}, "safetensors");
  written.push_back(index_path);
  return written;
}

}  // namespace moetrain::io
