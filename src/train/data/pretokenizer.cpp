// defines: the split-pattern matchers of train/data/pretokenizer.h. Each follows its regex's alternatives in order,
// greedy quantifiers backtracking as Oniguruma (the engine of Hugging Face tokenizers) would; the comments give the
// alternative each block implements.
#include "train/data/pretokenizer.h"

#include <array>

#include "core/error.h"
#include "train/data/unicode.h"

namespace moetrain::train::data {

namespace {

using unicode::Category;

struct KnownPattern {
  SplitPattern pattern;
  std::string_view name;
  std::string_view regex;
};

constexpr std::array<KnownPattern, 7> kKnownPatterns{{
    {SplitPattern::kGpt2, "gpt2", R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re"},
    {SplitPattern::kQwen2, "qwen2",
     R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"},
    {SplitPattern::kCl100k, "cl100k",
     R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"},
    {SplitPattern::kO200k, "o200k",
     R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"},
    {SplitPattern::kDeepSeekDigits, "deepseek_v3_digits", R"re(\p{N}{1,3})re"},
    {SplitPattern::kDeepSeekCjk, "deepseek_v3_cjk", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"},
    {SplitPattern::kDeepSeekMain, "deepseek_v3",
     R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"},
}};

// Character tests on code point i.
struct View {
  const CodePointText& t;
  size_t end;
  char32_t cp(size_t i) const { return t.cp[i]; }
  Category cat(size_t i) const { return unicode::category(t.props[i]); }
  bool ws(size_t i) const { return (t.props[i] & unicode::kWhiteSpaceBit) != 0; }
  bool letter(size_t i) const { return unicode::is_letter(cat(i)); }
  bool number(size_t i) const { return unicode::is_number(cat(i)); }
  bool crlf(size_t i) const { return t.cp[i] == '\r' || t.cp[i] == '\n'; }
  // [^\s\p{L}\p{N}]
  bool other(size_t i) const { return !ws(i) && !letter(i) && !number(i); }
  // The end of the run of code points from i that satisfy `pred`.
  template <typename Pred>
  size_t run(size_t i, Pred pred) const {
    while (i < end && pred(i)) ++i;
    return i;
  }
};

// The length of 's|'t|'re|'ve|'m|'ll|'d at i (0 if none); `fold` makes it (?i:...), where Unicode case folding also
// takes U+017F LATIN SMALL LETTER LONG S for s.
size_t contraction(const View& v, size_t i, bool fold) {
  if (i + 1 >= v.end || v.cp(i) != '\'') return 0;
  const auto lower = [&](size_t k) -> char32_t {
    const char32_t c = v.cp(k);
    if (!fold) return c;
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c == 0x17F) return 's';
    return c;
  };
  const char32_t a = lower(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= v.end) return 0;
  const char32_t b = lower(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at i (a white-space code point): the run, less its last code point when a non-space follows and
// the run is longer than one.
size_t spaces(const View& v, size_t i) {
  const size_t j = v.run(i, [&](size_t k) { return v.ws(k); });
  if (j == v.end || j - i == 1) return j;
  return j - 1;
}

// \s*[\r\n]+ at i: up to the last CR or LF of the white-space run from i; i when the run holds none.
size_t spaces_to_newline(const View& v, size_t i) {
  const size_t j = v.run(i, [&](size_t k) { return v.ws(k); });
  for (size_t k = j; k > i; --k) {
    if (v.crlf(k - 1)) return k;
  }
  return i;
}

size_t digits(const View& v, size_t i, size_t most) {
  size_t j = i;
  while (j < v.end && j - i < most && v.number(j)) ++j;
  return j;
}

size_t match_gpt2(const View& v, size_t i) {
  if (const size_t n = contraction(v, i, false)) return i + n;
  const bool space = v.cp(i) == ' ' && i + 1 < v.end;
  const auto optional_space_run = [&](auto pred) -> size_t {
    if (space && pred(i + 1)) return v.run(i + 1, pred);
    if (pred(i)) return v.run(i, pred);
    return i;
  };
  if (size_t j = optional_space_run([&](size_t k) { return v.letter(k); }); j > i) return j;  //  ?\p{L}+
  if (size_t j = optional_space_run([&](size_t k) { return v.number(k); }); j > i) return j;  //  ?\p{N}+
  if (size_t j = optional_space_run([&](size_t k) { return v.other(k); }); j > i) return j;   //  ?[^\s\p{L}\p{N}]+
  return v.ws(i) ? spaces(v, i) : i;                                                          // \s+(?!\S)|\s+
}

// Qwen2 (most_digits 1) and cl100k (3).
size_t match_qwen2(const View& v, size_t i, size_t most_digits) {
  if (const size_t n = contraction(v, i, true)) return i + n;
  const auto letter = [&](size_t k) { return v.letter(k); };
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (v.letter(i)) return v.run(i, letter);
  if (!v.crlf(i) && !v.number(i) && i + 1 < v.end && v.letter(i + 1)) return v.run(i + 1, letter);
  // \p{N} or \p{N}{1,3}
  if (v.number(i)) return digits(v, i, most_digits);
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const auto other = [&](size_t k) { return v.other(k); };
  const auto crlf = [&](size_t k) { return v.crlf(k); };
  if (v.other(i)) return v.run(v.run(i, other), crlf);
  if (v.cp(i) == ' ' && i + 1 < v.end && v.other(i + 1)) return v.run(v.run(i + 1, other), crlf);
  if (!v.ws(i)) return i;
  if (const size_t j = spaces_to_newline(v, i); j > i) return j;  // \s*[\r\n]+
  return spaces(v, i);                                            // \s+(?!\S)|\s+
}

size_t match_o200k(const View& v, size_t i) {
  // U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], W = [\p{Ll}\p{Lm}\p{Lo}\p{M}]
  const auto upper = [&](size_t k) {
    const Category c = v.cat(k);
    return c == Category::Lu || c == Category::Lt || c == Category::Lm || c == Category::Lo || unicode::is_mark(c);
  };
  const auto lower = [&](size_t k) {
    const Category c = v.cat(k);
    return c == Category::Ll || c == Category::Lm || c == Category::Lo || unicode::is_mark(c);
  };
  // U* W+ C? from a: U* gives back code points until W+ can start, so W+ starts at the last W position of
  // [a, end of the U run]; i when there is none.
  const auto first = [&](size_t a) -> size_t {
    const size_t u_end = v.run(a, upper);
    size_t b = u_end;
    if (!(b < v.end && lower(b))) {
      while (b > a && !lower(b - 1)) --b;
      if (b == a) return i;
      --b;
    }
    const size_t w_end = v.run(b, lower);
    return w_end + contraction(v, w_end, true);
  };
  // U+ W* C? from a.
  const auto second = [&](size_t a) -> size_t {
    const size_t u_end = v.run(a, upper);
    if (u_end == a) return i;
    const size_t w_end = v.run(u_end, lower);
    return w_end + contraction(v, w_end, true);
  };
  // [^\r\n\p{L}\p{N}]? before either: taken first, then given back.
  const bool prefix = !v.crlf(i) && !v.letter(i) && !v.number(i) && i + 1 < v.end;
  if (prefix) {
    if (const size_t j = first(i + 1); j > i) return j;
  }
  if (const size_t j = first(i); j > i) return j;
  if (prefix) {
    if (const size_t j = second(i + 1); j > i) return j;
  }
  if (const size_t j = second(i); j > i) return j;
  if (v.number(i)) return digits(v, i, 3);  // \p{N}{1,3}
  //  ?[^\s\p{L}\p{N}]+[\r\n/]*
  const auto other = [&](size_t k) { return v.other(k); };
  const auto crlf_slash = [&](size_t k) { return v.crlf(k) || v.cp(k) == '/'; };
  if (v.other(i)) return v.run(v.run(i, other), crlf_slash);
  if (v.cp(i) == ' ' && i + 1 < v.end && v.other(i + 1)) return v.run(v.run(i + 1, other), crlf_slash);
  if (!v.ws(i)) return i;
  if (const size_t j = spaces_to_newline(v, i); j > i) return j;
  return spaces(v, i);
}

bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x3040 && c <= 0x309F) || (c >= 0x30A0 && c <= 0x30FF);
}

size_t match_deepseek_main(const View& v, size_t i) {
  const auto ascii_punct = [&](size_t k) {
    const char32_t c = v.cp(k);
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
  };
  const auto ascii_letter = [&](size_t k) {
    const char32_t c = v.cp(k);
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
  };
  // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
  if (ascii_punct(i) && i + 1 < v.end && ascii_letter(i + 1)) return v.run(i + 1, ascii_letter);
  const auto punct_symbol = [&](size_t k) { return unicode::is_punctuation(v.cat(k)) || unicode::is_symbol(v.cat(k)); };
  const auto letter_mark = [&](size_t k) { return v.letter(k) || unicode::is_mark(v.cat(k)); };
  // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
  if (!v.crlf(i) && !v.letter(i) && !punct_symbol(i) && i + 1 < v.end && letter_mark(i + 1)) {
    return v.run(i + 1, letter_mark);
  }
  if (letter_mark(i)) return v.run(i, letter_mark);
  //  ?[\p{P}\p{S}]+[\r\n]*
  const auto crlf = [&](size_t k) { return v.crlf(k); };
  if (punct_symbol(i)) return v.run(v.run(i, punct_symbol), crlf);
  if (v.cp(i) == ' ' && i + 1 < v.end && punct_symbol(i + 1)) return v.run(v.run(i + 1, punct_symbol), crlf);
  if (!v.ws(i)) return i;
  if (const size_t j = spaces_to_newline(v, i); j > i) return j;
  return spaces(v, i);
}

}  // namespace

std::optional<SplitPattern> recognise_split_pattern(std::string_view regex) {
  std::string spelled;
  spelled.reserve(regex.size());
  for (char c : regex) {
    if (c == '\r') {
      spelled += "\\r";
    } else if (c == '\n') {
      spelled += "\\n";
    } else {
      spelled += c;
    }
  }
  for (const KnownPattern& known : kKnownPatterns) {
    if (known.regex == spelled) return known.pattern;
  }
  return std::nullopt;
}

std::string_view split_pattern_name(SplitPattern pattern) {
  for (const KnownPattern& known : kKnownPatterns) {
    if (known.pattern == pattern) return known.name;
  }
  return "?";
}

std::string supported_split_patterns() {
  std::string names;
  for (const KnownPattern& known : kKnownPatterns) names += (names.empty() ? "" : ", ") + std::string(known.name);
  return names;
}

void CodePointText::assign(std::string_view text) {
  cp.clear();
  props.clear();
  offset.clear();
  for (size_t pos = 0; pos < text.size();) {
    int n = 1;
    const unsigned char b = static_cast<unsigned char>(text[pos]);
    const char32_t c = b < 0x80 ? b : unicode::decode_utf8(text, pos, &n);
    cp.push_back(c);
    props.push_back(unicode::properties(c));
    offset.push_back(static_cast<uint32_t>(pos));
    pos += n;
  }
  offset.push_back(static_cast<uint32_t>(text.size()));
}

size_t match_split_pattern(SplitPattern pattern, const CodePointText& text, size_t i, size_t end) {
  const View v{text, end};
  switch (pattern) {
    case SplitPattern::kGpt2: return match_gpt2(v, i);
    case SplitPattern::kQwen2: return match_qwen2(v, i, 1);
    case SplitPattern::kCl100k: return match_qwen2(v, i, 3);
    case SplitPattern::kO200k: return match_o200k(v, i);
    case SplitPattern::kDeepSeekDigits: return v.number(i) ? digits(v, i, 3) : i;
    case SplitPattern::kDeepSeekCjk: return v.run(i, [&](size_t k) { return is_cjk(v.cp(k)); });
    case SplitPattern::kDeepSeekMain: return match_deepseek_main(v, i);
  }
  MT_FAIL("tokenizer: unknown split pattern {}", static_cast<int>(pattern));
}

void split_isolated(SplitPattern pattern, const CodePointText& text, size_t begin, size_t end,
                    std::vector<std::pair<uint32_t, uint32_t>>& out) {
  size_t gap = begin;
  for (size_t pos = begin; pos < end;) {
    const size_t match = match_split_pattern(pattern, text, pos, end);
    if (match == pos) {
      ++pos;
      continue;
    }
    if (gap < pos) out.emplace_back(static_cast<uint32_t>(gap), static_cast<uint32_t>(pos));
    out.emplace_back(static_cast<uint32_t>(pos), static_cast<uint32_t>(match));
    pos = gap = match;
  }
  if (gap < end) out.emplace_back(static_cast<uint32_t>(gap), static_cast<uint32_t>(end));
}

}  // namespace moetrain::train::data
