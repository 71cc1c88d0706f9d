// defines: BpeTokenizer, the byte-level BPE of Hugging Face fast tokenizers read from a tokenizer.json (as Qwen2/3,
// DeepSeek-V3, GPT-OSS and GPT-2 ship them), and BpeEncoder, one thread's encoder with its word cache. Ids are the
// `tokenizers` library's encode(text, add_special_tokens=False); anything the file asks for that is not implemented
// is refused by name when it is loaded.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "train/data/pretokenizer.h"

namespace moetrain::train::data {

// An entry of tokenizer.json's added_tokens.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;   // matched in the normalised text (content normalised too) rather than the raw one
  bool lstrip = false;       // takes the white space before it
  bool rstrip = false;       // takes the white space after it
  bool single_word = false;  // only where no word character touches it
};

// The end-of-document id and where it came from ("--eod", "added token <|endoftext|>", ...).
struct EodChoice {
  int32_t id = 0;
  std::string source;
};

class BpeTokenizer {
 public:
  // Reads `path`: a tokenizer.json, or a folder holding one. Errors name the file, the key and what is supported.
  static BpeTokenizer load(const std::string& path);
  // Parses tokenizer.json text; `origin` names it in errors.
  static BpeTokenizer from_json(std::string_view json, const std::string& origin);

  const std::string& origin() const { return origin_; }
  // Largest id (vocabulary or added token) + 1.
  int64_t vocab_size() const { return vocab_size_; }
  // The id of the added token or vocabulary entry spelled `content` (vocabulary entries in their byte-level
  // spelling, as tokenizer.json has them), or nullopt.
  std::optional<int32_t> token_id(std::string_view content) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  // One line: the model, merges, normaliser, pre-tokenizer patterns, added tokens.
  std::string describe() const;
  // Set when the file's post_processor would add tokens (a BOS, say) that encode-for-training leaves out.
  const std::string& post_processor_note() const { return post_processor_note_; }

  // The ids of `text` (no post-processing: nothing is added). Uses a temporary encoder; BpeEncoder is faster.
  std::vector<int32_t> encode(std::string_view text) const;

 private:
  friend class BpeEncoder;
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  // Added tokens matched at one stage (raw or normalised text): the patterns of each first byte, longest first.
  struct AddedMatcher {
    std::array<std::vector<std::pair<std::string, int32_t>>, 256> by_first_byte;  // (pattern, index into added_)
    bool empty = true;
  };

  std::string origin_;
  int64_t vocab_size_ = 0;
  std::unordered_map<std::string, int32_t> vocab_;        // byte-level spelling -> id
  std::unordered_map<std::string, int32_t> bytes_to_id_;  // raw bytes -> id (vocabulary entries that are bytes)
  std::array<int32_t, 256> byte_id_{};                    // the id of each single byte, -1 when absent
  std::unordered_map<uint64_t, Merge> merges_;            // (left id << 32 | right id) -> rank, merged id
  int64_t merge_count_ = 0;
  bool ignore_merges_ = false;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool nfc_ = false;
  std::vector<SplitPattern> splits_;  // applied in order, each to every piece of the previous
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int32_t> added_ids_;  // content -> id
  AddedMatcher raw_matcher_, normalized_matcher_;
  std::string post_processor_note_;
};

// Encodes texts with one tokenizer on one thread: scratch buffers and a bounded cache of word -> ids are kept
// between calls. Not shared between threads; the tokenizer must outlive it.
class BpeEncoder {
 public:
  explicit BpeEncoder(const BpeTokenizer& tokenizer, size_t cache_entries = 1 << 16);
  // Appends the ids of `text` to `out`.
  void encode(std::string_view text, std::vector<int32_t>& out);

 private:
  struct Segment {
    int32_t added = -1;  // index into added_tokens(), or -1 for text
    size_t begin = 0, end = 0;
  };
  void find_added(std::string_view text, const BpeTokenizer::AddedMatcher& matcher, std::vector<Segment>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out);  // normalised text without added tokens
  void encode_word(std::string_view word, std::vector<int32_t>& out);  // one pre-tokenized piece
  void bpe(std::string_view word, std::vector<int32_t>& out);

  const BpeTokenizer& tok_;
  size_t cache_entries_;
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
  CodePointText cps_;
  std::vector<std::pair<uint32_t, uint32_t>> pieces_, next_pieces_;
  std::vector<Segment> raw_segments_, norm_segments_;
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    int32_t len;
  };
  std::vector<Symbol> symbols_;
  std::vector<std::pair<uint64_t, int32_t>> queue_;  // (rank << 32 | position, new id): a min-heap
};

// The end-of-document id for `tokenizer` loaded from `path`: `eod` when given (it must be an id of the tokenizer);
// else the special added token "<|endoftext|>" (Qwen2/3, GPT-OSS, GPT-2 end documents with it); else the eos_token
// of the tokenizer_config.json beside the tokenizer.json (DeepSeek's <｜end▁of▁sentence｜>); else an error asking for
// --eod.
EodChoice choose_eod(const BpeTokenizer& tokenizer, const std::string& path, std::optional<int64_t> eod);

}  // namespace moetrain::train::data
