// defines: the Unicode lookups and NFC of train/data/unicode.h over the generated tables (unicode_tables.cpp): a
// flat properties table of one byte per code point, and UAX #15's decompose / reorder / compose.
#include "train/data/unicode.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "train/data/unicode_tables.h"

namespace moetrain::train::data::unicode {

namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;

// Hangul syllable arithmetic (Unicode chapter 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

struct Tables {
  std::vector<uint8_t> props;          // properties byte per code point
  std::vector<uint8_t> ccc;            // combining class per code point
  std::vector<uint64_t> nfc_unstable;  // one bit per code point
};

const Tables& tables() {
  static const Tables t = [] {
    Tables t;
    t.props.assign(kMaxCodePoint + 1, static_cast<uint8_t>(Category::Cn));
    for (int i = 0; i < kCategoryRangeCount; ++i) {
      const CategoryRange& r = kCategoryRanges[i];
      std::fill(t.props.begin() + r.first, t.props.begin() + r.last + 1, r.value);
    }
    for (int i = 0; i < kWhiteSpaceCount; ++i) {
      for (char32_t cp = kWhiteSpace[i].first; cp <= kWhiteSpace[i].last; ++cp) t.props[cp] |= kWhiteSpaceBit;
    }
    for (int i = 0; i < kAlphabeticCount; ++i) {
      for (char32_t cp = kAlphabetic[i].first; cp <= kAlphabetic[i].last; ++cp) t.props[cp] |= kAlphabeticBit;
    }
    t.ccc.assign(kMaxCodePoint + 1, 0);
    for (int i = 0; i < kCombiningClassRangeCount; ++i) {
      const CategoryRange& r = kCombiningClassRanges[i];
      std::fill(t.ccc.begin() + r.first, t.ccc.begin() + r.last + 1, r.value);
    }
    t.nfc_unstable.assign((kMaxCodePoint + 64) / 64, 0);
    for (int i = 0; i < kNfcUnstableCount; ++i) {
      for (char32_t cp = kNfcUnstable[i].first; cp <= kNfcUnstable[i].last; ++cp) {
        t.nfc_unstable[cp / 64] |= uint64_t{1} << (cp % 64);
      }
    }
    return t;
  }();
  return t;
}

uint8_t combining_class(char32_t cp) { return tables().ccc[cp]; }

// Appends the full canonical decomposition of cp.
void decompose(char32_t cp, std::u32string& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const Decomposition* end = kDecompositions + kDecompositionCount;
  const Decomposition* it =
      std::lower_bound(kDecompositions, end, cp, [](const Decomposition& d, char32_t c) { return d.code_point < c; });
  if (it != end && it->code_point == cp) {
    out.append(kDecompositionData + it->offset, it->length);
  } else {
    out.push_back(cp);
  }
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const Composition* end = kCompositions + kCompositionCount;
  const Composition* it = std::lower_bound(kCompositions, end, std::pair{a, b}, [](const Composition& c, auto key) {
    return c.first < key.first || (c.first == key.first && c.second < key.second);
  });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

uint8_t properties(char32_t cp) { return cp <= kMaxCodePoint ? tables().props[cp] : 0; }

const char* unicode_version() { return kUnicodeVersion; }

char32_t decode_utf8(std::string_view text, size_t pos, int* length) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(pos);
  if (b0 < 0x80) {
    *length = 1;
    return b0;
  }
  int n = 0;
  char32_t cp = 0, min = 0;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4, cp = b0 & 0x07, min = 0x10000;
  }
  MT_CHECK(n > 0 && pos + n <= text.size(), "tokenizer: malformed UTF-8 at byte {} (lead byte 0x{:02x})", pos, b0);
  for (int k = 1; k < n; ++k) {
    const unsigned char b = byte(pos + k);
    MT_CHECK((b & 0xC0) == 0x80, "tokenizer: malformed UTF-8 at byte {} (continuation byte 0x{:02x})", pos + k, b);
    cp = (cp << 6) | (b & 0x3F);
  }
  MT_CHECK(cp >= min && cp <= kMaxCodePoint && (cp < 0xD800 || cp > 0xDFFF),
           "tokenizer: malformed UTF-8 at byte {} (code point U+{:04X} is overlong, a surrogate or too large)", pos,
           static_cast<uint32_t>(cp));
  *length = n;
  return cp;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_nfc_quick(std::string_view text) {
  const std::vector<uint64_t>& unstable = tables().nfc_unstable;
  for (size_t pos = 0; pos < text.size();) {
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    int n = 0;
    const char32_t cp = decode_utf8(text, pos, &n);
    if ((unstable[cp / 64] >> (cp % 64)) & 1) return false;
    pos += n;
  }
  return true;
}

std::string nfc(std::string_view text) {
  if (is_nfc_quick(text)) return std::string(text);
  // 1. Full canonical decomposition.
  std::u32string d;
  d.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    int n = 0;
    decompose(decode_utf8(text, pos, &n), d);
    pos += n;
  }
  // 2. Canonical ordering: each run of non-starters sorted stably by combining class.
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // 3. Canonical composition: a character combines with the last starter unless blocked (a character between them
  // with class 0 or a class >= its own).
  std::u32string out;
  out.reserve(d.size());
  size_t starter = std::u32string::npos;
  uint8_t last_class = 0;
  for (char32_t c : d) {
    const uint8_t cc = combining_class(c);
    if (starter != std::u32string::npos) {
      const bool adjacent = out.size() - 1 == starter;
      if (adjacent || (last_class != 0 && last_class < cc)) {
        if (const char32_t composite = compose(out[starter], c)) {
          out[starter] = composite;
          continue;
        }
      }
    }
    if (cc == 0) starter = out.size();
    out.push_back(c);
    last_class = cc;
  }
  std::string result;
  result.reserve(text.size() + 8);
  for (char32_t c : out) append_utf8(c, result);
  return result;
}

}  // namespace moetrain::train::data::unicode
