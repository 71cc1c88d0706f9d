// defines: BpeTokenizer::load / from_json (reading a Hugging Face tokenizer.json: the BPE model, normaliser,
// pre-tokenizer, added tokens and post-processor, refusing by name what is not implemented) and choose_eod.
#include "train/data/bpe_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/data/unicode.h"

namespace moetrain::train::data {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n in byte order.
std::array<char32_t, 256> byte_to_char() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

// The raw bytes a byte-level spelling stands for, or nullopt when a character is not one of the 256.
std::optional<std::string> byte_level_to_bytes(std::string_view spelling) {
  static const std::unordered_map<char32_t, unsigned char> inverse = [] {
    std::unordered_map<char32_t, unsigned char> m;
    const auto map = byte_to_char();
    for (int b = 0; b < 256; ++b) m[map[b]] = static_cast<unsigned char>(b);
    return m;
  }();
  std::string bytes;
  for (size_t pos = 0; pos < spelling.size();) {
    int n = 0;
    const char32_t cp = unicode::decode_utf8(spelling, pos, &n);
    const auto it = inverse.find(cp);
    if (it == inverse.end()) return std::nullopt;
    bytes.push_back(static_cast<char>(it->second));
    pos += n;
  }
  return bytes;
}

std::string type_of(const json& node, const std::string& where) {
  MT_CHECK(node.is_object(), "{} is {} (expected an object with a \"type\")", where, node.type_name());
  const auto it = node.find("type");
  MT_CHECK(it != node.end() && it->is_string(), "{} has no \"type\" string (expected one, e.g. \"BPE\")", where);
  return it->get<std::string>();
}

bool flag(const json& node, const char* key, bool fallback, const std::string& where) {
  const auto it = node.find(key);
  if (it == node.end() || it->is_null()) return fallback;
  MT_CHECK(it->is_boolean(), "{}.{} is {} (expected true or false)", where, key, it->type_name());
  return it->get<bool>();
}

int32_t token_id_value(const json& value, const std::string& where) {
  MT_CHECK(value.is_number_integer(), "{} is {} (expected a token id)", where, value.type_name());
  const int64_t id = value.get<int64_t>();
  MT_CHECK(id >= 0 && id <= std::numeric_limits<int32_t>::max(), "{} is {} (expected a token id in [0, 2^31))", where,
           id);
  return static_cast<int32_t>(id);
}

// Normaliser: null, NFC, or a Sequence of these. Returns whether NFC applies.
void read_normalizer(const json& node, const std::string& where, bool& nfc) {
  if (node.is_null()) return;
  const std::string type = type_of(node, where);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const auto it = node.find("normalizers");
    MT_CHECK(it != node.end() && it->is_array(), "{}: a Sequence without a \"normalizers\" array", where);
    for (size_t k = 0; k < it->size(); ++k) read_normalizer((*it)[k], fmt::format("{}.normalizers[{}]", where, k), nfc);
  } else {
    MT_FAIL("{}: normalizer type '{}' is not supported (supported: NFC, or a Sequence of them; none)", where, type);
  }
}

// Pre-tokenizer: Split(Regex, Isolated) steps then ByteLevel, or a Sequence of them.
void read_pre_tokenizer(const json& node, const std::string& where, std::vector<SplitPattern>& splits,
                        bool& byte_level) {
  const std::string type = type_of(node, where);
  MT_CHECK(!byte_level, "{}: a '{}' after ByteLevel is not supported (expected ByteLevel last)", where, type);
  if (type == "Sequence") {
    const auto it = node.find("pretokenizers");
    MT_CHECK(it != node.end() && it->is_array(), "{}: a Sequence without a \"pretokenizers\" array", where);
    for (size_t k = 0; k < it->size(); ++k) {
      read_pre_tokenizer((*it)[k], fmt::format("{}.pretokenizers[{}]", where, k), splits, byte_level);
    }
  } else if (type == "Split") {
    const auto pattern = node.find("pattern");
    MT_CHECK(pattern != node.end() && pattern->is_object(), "{}: Split without a \"pattern\" object", where);
    const auto regex = pattern->find("Regex");
    MT_CHECK(regex != pattern->end() && regex->is_string(),
             "{}: Split pattern {} is not supported (expected {{\"Regex\": \"...\"}})", where, pattern->dump());
    const auto behavior = node.find("behavior");
    MT_CHECK(behavior != node.end() && behavior->is_string() && behavior->get<std::string>() == "Isolated",
             "{}: Split behavior {} is not supported (supported: \"Isolated\")", where,
             behavior == node.end() ? "(absent)" : behavior->dump());
    MT_CHECK(!flag(node, "invert", false, where), "{}: Split with invert true is not supported", where);
    const std::string& text = regex->get_ref<const std::string&>();
    const std::optional<SplitPattern> known = recognise_split_pattern(text);
    MT_CHECK(known.has_value(),
             "{}: the Split regex {} is not one this tokenizer implements (supported: the patterns of {}; a general "
             "regex engine is out of scope)",
             where, json(text).dump(), supported_split_patterns());
    splits.push_back(*known);
  } else if (type == "ByteLevel") {
    MT_CHECK(!flag(node, "add_prefix_space", false, where),
             "{}: ByteLevel add_prefix_space true is not supported (expected false)", where);
    if (flag(node, "use_regex", true, where)) splits.push_back(SplitPattern::kGpt2);
    byte_level = true;
  } else {
    MT_FAIL("{}: pre_tokenizer type '{}' is not supported (supported: ByteLevel, Split with a known regex, Sequence)",
            where, type);
  }
}

// A note on what the post-processor would add that data prepare does not.
std::string describe_post_processor(const json& node, const std::string& where) {
  if (node.is_null()) return "";
  const std::string type = type_of(node, where);
  if (type == "ByteLevel") return "";
  if (type == "Sequence") {
    std::string note;
    const auto it = node.find("processors");
    if (it != node.end() && it->is_array()) {
      for (const json& p : *it) {
        const std::string n = describe_post_processor(p, where);
        if (!n.empty()) note += (note.empty() ? "" : "; ") + n;
      }
    }
    return note;
  }
  std::string tokens;
  const auto special = node.find("special_tokens");
  if (special != node.end() && special->is_object()) {
    for (const auto& [name, value] : special->items()) tokens += (tokens.empty() ? "" : ", ") + name;
  }
  return fmt::format("its post_processor ({}{}) is not applied: documents get no BOS or other added ids, only the EOD",
                     type, tokens.empty() ? "" : ", adding " + tokens);
}

}  // namespace

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  fs::path file = path;
  std::error_code ec;
  if (fs::is_directory(file, ec)) file /= "tokenizer.json";
  std::ifstream in(file, std::ios::binary);
  MT_CHECK(in.is_open(), "tokenizer: cannot open {} (expected a tokenizer.json, or a folder holding one)",
           file.string());
  std::ostringstream text;
  text << in.rdbuf();
  MT_CHECK(!in.bad(), "tokenizer: reading {} failed", file.string());
  return from_json(text.str(), file.string());
}

BpeTokenizer BpeTokenizer::from_json(std::string_view text, const std::string& origin) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    MT_FAIL("{}: not JSON ({}); expected a Hugging Face tokenizer.json", origin, e.what());
  }
  MT_CHECK(root.is_object(), "{}: the file is a JSON {} (expected a tokenizer.json object)", origin, root.type_name());
  BpeTokenizer tok;
  tok.origin_ = origin;

  // The model.
  const auto model_it = root.find("model");
  MT_CHECK(model_it != root.end() && model_it->is_object(), "{}: no \"model\" object (expected the BPE model)", origin);
  const json& model = *model_it;
  const std::string where = origin + ": model";
  const std::string type = type_of(model, where);
  MT_CHECK(type == "BPE", "{}: model type '{}' is not supported (supported: BPE)", origin, type);
  const auto dropout = model.find("dropout");
  MT_CHECK(dropout == model.end() || dropout->is_null(), "{}.dropout is {} (expected null: dropout is not supported)",
           where, dropout == model.end() ? "" : dropout->dump());
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(key);
    MT_CHECK(it == model.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty()),
             "{}.{} is {} (expected null: not supported)", where, key, it == model.end() ? "" : it->dump());
  }
  MT_CHECK(!flag(model, "byte_fallback", false, where), "{}.byte_fallback true is not supported (expected false)",
           where);
  tok.ignore_merges_ = flag(model, "ignore_merges", false, where);
  tok.fuse_unk_ = flag(model, "fuse_unk", false, where);

  const auto vocab = model.find("vocab");
  MT_CHECK(vocab != model.end() && vocab->is_object(), "{}: no \"vocab\" object (expected token -> id)", where);
  MT_CHECK(!vocab->empty(), "{}.vocab is empty", where);
  tok.vocab_.reserve(vocab->size());
  tok.bytes_to_id_.reserve(vocab->size());
  tok.byte_id_.fill(-1);
  int64_t max_id = -1;
  for (const auto& [spelling, value] : vocab->items()) {
    const int32_t id = token_id_value(value, fmt::format("{}.vocab[{}]", where, json(spelling).dump()));
    tok.vocab_.emplace(spelling, id);
    max_id = std::max<int64_t>(max_id, id);
    if (std::optional<std::string> bytes = byte_level_to_bytes(spelling)) {
      if (bytes->size() == 1) tok.byte_id_[static_cast<unsigned char>((*bytes)[0])] = id;
      tok.bytes_to_id_.emplace(std::move(*bytes), id);
    }
  }
  const auto unk = model.find("unk_token");
  if (unk != model.end() && !unk->is_null()) {
    MT_CHECK(unk->is_string(), "{}.unk_token is {} (expected a string or null)", where, unk->type_name());
    const auto it = tok.vocab_.find(unk->get<std::string>());
    MT_CHECK(it != tok.vocab_.end(), "{}.unk_token {} is not in model.vocab", where, unk->dump());
    tok.unk_id_ = it->second;
  }

  const auto merges = model.find("merges");
  MT_CHECK(merges != model.end() && merges->is_array(),
           "{}: no \"merges\" array (expected \"a b\" strings or [a, b] pairs)", where);
  tok.merges_.reserve(merges->size() * 2);
  for (size_t k = 0; k < merges->size(); ++k) {
    const json& m = (*merges)[k];
    std::string left, right;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      MT_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
               "{}.merges[{}] is {} (expected two tokens separated by one space)", where, k, m.dump());
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else {
      MT_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
               "{}.merges[{}] is {} (expected \"a b\" or [\"a\", \"b\"])", where, k, m.dump());
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    const auto find = [&](const std::string& token, const char* role) {
      const auto it = tok.vocab_.find(token);
      MT_CHECK(it != tok.vocab_.end(), "{}.merges[{}] ({}) names the {} token {}, which is not in model.vocab", where,
               k, m.dump(), role, json(token).dump());
      return it->second;
    };
    const int32_t a = find(left, "left"), b = find(right, "right"), merged = find(left + right, "merged");
    // A pair listed twice keeps its later rank, as the tokenizers library's map does.
    tok.merges_[(static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b)] = Merge{static_cast<int32_t>(k), merged};
  }
  tok.merge_count_ = static_cast<int64_t>(merges->size());

  // The normaliser and the pre-tokenizer.
  const auto normalizer = root.find("normalizer");
  if (normalizer != root.end()) read_normalizer(*normalizer, origin + ": normalizer", tok.nfc_);
  const auto pre = root.find("pre_tokenizer");
  MT_CHECK(pre != root.end() && !pre->is_null(),
           "{}: no pre_tokenizer (a byte-level BPE needs ByteLevel, alone or after Split steps)", origin);
  bool byte_level = false;
  read_pre_tokenizer(*pre, origin + ": pre_tokenizer", tok.splits_, byte_level);
  MT_CHECK(byte_level, "{}: the pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)", origin);

  // Added tokens.
  const auto added = root.find("added_tokens");
  if (added != root.end() && !added->is_null()) {
    MT_CHECK(added->is_array(), "{}: added_tokens is {} (expected an array)", origin, added->type_name());
    for (size_t k = 0; k < added->size(); ++k) {
      const json& a = (*added)[k];
      const std::string at = fmt::format("{}: added_tokens[{}]", origin, k);
      MT_CHECK(a.is_object(), "{} is {} (expected an object)", at, a.type_name());
      const auto id = a.find("id");
      const auto content = a.find("content");
      MT_CHECK(id != a.end() && content != a.end() && content->is_string(), "{} lacks \"id\" or a \"content\" string",
               at);
      AddedToken token;
      token.id = token_id_value(*id, at + ".id");
      token.content = content->get<std::string>();
      MT_CHECK(!token.content.empty(), "{} has empty content", at);
      token.special = flag(a, "special", false, at);
      token.normalized = flag(a, "normalized", !token.special, at);
      token.lstrip = flag(a, "lstrip", false, at);
      token.rstrip = flag(a, "rstrip", false, at);
      token.single_word = flag(a, "single_word", false, at);
      max_id = std::max<int64_t>(max_id, token.id);
      tok.added_ids_.emplace(token.content, token.id);
      tok.added_.push_back(std::move(token));
    }
  }
  for (size_t k = 0; k < tok.added_.size(); ++k) {
    const AddedToken& token = tok.added_[k];
    AddedMatcher& matcher = token.normalized ? tok.normalized_matcher_ : tok.raw_matcher_;
    std::string pattern = token.normalized && tok.nfc_ ? unicode::nfc(token.content) : token.content;
    matcher.by_first_byte[static_cast<unsigned char>(pattern[0])].emplace_back(std::move(pattern),
                                                                               static_cast<int32_t>(k));
    matcher.empty = false;
  }
  for (AddedMatcher* matcher : {&tok.raw_matcher_, &tok.normalized_matcher_}) {
    for (auto& list : matcher->by_first_byte) {
      std::stable_sort(list.begin(), list.end(),
                       [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    }
  }
  tok.vocab_size_ = max_id + 1;

  const auto post = root.find("post_processor");
  if (post != root.end()) tok.post_processor_note_ = describe_post_processor(*post, origin + ": post_processor");
  return tok;
}

std::optional<int32_t> BpeTokenizer::token_id(std::string_view content) const {
  const std::string key(content);
  if (const auto it = added_ids_.find(key); it != added_ids_.end()) return it->second;
  if (const auto it = vocab_.find(key); it != vocab_.end()) return it->second;
  return std::nullopt;
}

std::string BpeTokenizer::describe() const {
  std::string patterns;
  for (SplitPattern p : splits_) patterns += (patterns.empty() ? "" : " + ") + std::string(split_pattern_name(p));
  int64_t special = 0;
  for (const AddedToken& t : added_) special += t.special ? 1 : 0;
  return fmt::format(
      "byte-level BPE, {} ids, {} merges{}; normalizer {}; pre-tokenizer {}; {} added tokens ({} special)", vocab_size_,
      merge_count_, ignore_merges_ ? " (ignore_merges)" : "", nfc_ ? "NFC" : "none",
      patterns.empty() ? "bytes only" : patterns, added_.size(), special);
}

EodChoice choose_eod(const BpeTokenizer& tokenizer, const std::string& path, std::optional<int64_t> eod) {
  if (eod.has_value()) {
    MT_CHECK(*eod >= 0 && *eod < tokenizer.vocab_size(),
             "data prepare: --eod {} is not an id of {} (expected an id in [0, {}))", *eod, tokenizer.origin(),
             tokenizer.vocab_size());
    return {static_cast<int32_t>(*eod), "--eod"};
  }
  for (const AddedToken& token : tokenizer.added_tokens()) {
    if (token.special && token.content == "<|endoftext|>") return {token.id, "the special added token <|endoftext|>"};
  }
  std::error_code ec;
  const fs::path folder = fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path();
  const fs::path config = folder / "tokenizer_config.json";
  if (fs::exists(config, ec)) {
    std::ifstream in(config, std::ios::binary);
    json root;
    try {
      root = json::parse(in);
    } catch (const json::parse_error& e) {
      MT_FAIL("{}: not JSON ({}); pass --eod ID to choose the end-of-document id", config.string(), e.what());
    }
    const auto it = root.is_object() ? root.find("eos_token") : root.end();
    if (root.is_object() && it != root.end()) {
      std::string name;
      if (it->is_string()) {
        name = it->get<std::string>();
      } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
        name = (*it)["content"].get<std::string>();
      }
      if (!name.empty()) {
        const std::optional<int32_t> id = tokenizer.token_id(name);
        MT_CHECK(id.has_value(), "{}: eos_token {} is not a token of {}; pass --eod ID", config.string(),
                 json(name).dump(), tokenizer.origin());
        return {*id, fmt::format("eos_token {} of {}", name, config.string())};
      }
    }
  }
  MT_FAIL(
      "data prepare: {} has no end-of-document token (no special added token <|endoftext|>, and no eos_token in a "
      "tokenizer_config.json beside it); pass --eod ID",
      tokenizer.origin());
}

}  // namespace moetrain::train::data
