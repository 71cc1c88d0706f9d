// defines: the pre-tokenizer split patterns the BPE tokenizer knows (GPT-2's, Qwen2/3's, cl100k / Llama 3's,
// o200k / GPT-OSS's, DeepSeek-V3's three), each a hand-coded matcher with the regex's exact backtracking result, and
// Split(behavior Isolated) over them. A general regex engine is out of scope: a pattern string is recognised exactly
// or refused by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moetrain::train::data {

enum class SplitPattern {
  kGpt2,            // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kQwen2,           // (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kCl100k,          // the same with \p{N}{1,3} (cl100k_base, Llama 3)
  kO200k,           // o200k_base (GPT-4o, GPT-OSS)
  kDeepSeekDigits,  // \p{N}{1,3} (DeepSeek-V3's first split)
  kDeepSeekCjk,     // [一-龥぀-ゟ゠-ヿ]+ (its second)
  kDeepSeekMain,    // its third: ASCII punctuation + letters, letters and marks, punctuation and symbols, spaces
};

// The pattern spelled exactly `regex` (a literal CR or LF and the escapes \r, \n are the same), or nullopt.
std::optional<SplitPattern> recognise_split_pattern(std::string_view regex);
std::string_view split_pattern_name(SplitPattern pattern);  // "qwen2", "o200k", ...
// The names of every recognised pattern, for error messages.
std::string supported_split_patterns();

// A text as code points: cp[i], its properties byte (unicode::properties) and its byte offset (offset has n + 1
// entries, offset[n] the byte length).
struct CodePointText {
  std::vector<char32_t> cp;
  std::vector<uint8_t> props;
  std::vector<uint32_t> offset;
  void assign(std::string_view text);  // decodes valid UTF-8 (malformed input is an error)
  size_t size() const { return cp.size(); }
};

// The end of the match of `pattern` starting at code point i (the regex anchored there, seeing only [i, end)), or i
// when there is none (no pattern matches the empty string).
size_t match_split_pattern(SplitPattern pattern, const CodePointText& text, size_t i, size_t end);

// Split(pattern, behavior Isolated, invert false) of code points [begin, end): every match is a piece and so is every
// gap between matches; pieces are appended to `out` as [first, last) code point ranges, in order.
void split_isolated(SplitPattern pattern, const CodePointText& text, size_t begin, size_t end,
                    std::vector<std::pair<uint32_t, uint32_t>>& out);

}  // namespace moetrain::train::data
