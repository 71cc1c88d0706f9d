// defines: the Unicode services of the BPE tokenizer: UTF-8 decoding and encoding, a code point's general category
// and White_Space / Alphabetic properties (one table lookup), and NFC normalisation with an already-NFC fast path.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain::train::data::unicode {

// General categories, in the order of scripts/gen_unicode_tables.py's CATEGORIES.
enum class Category : uint8_t {
  Cn,
  Lu,
  Ll,
  Lt,
  Lm,
  Lo,
  Mn,
  Mc,
  Me,
  Nd,
  Nl,
  No,
  Pc,
  Pd,
  Ps,
  Pe,
  Pi,
  Pf,
  Po,
  Sm,
  Sc,
  Sk,
  So,
  Zs,
  Zl,
  Zp,
  Cc,
  Cf,
  Cs,
  Co
};

// One byte per code point: the category in the low 5 bits, then White_Space and Alphabetic.
inline constexpr uint8_t kCategoryMask = 0x1f;
inline constexpr uint8_t kWhiteSpaceBit = 0x20;
inline constexpr uint8_t kAlphabeticBit = 0x40;

// The properties byte of `cp` (cp <= 0x10FFFF); the table is built once, on first use.
uint8_t properties(char32_t cp);
inline Category category(uint8_t props) { return static_cast<Category>(props & kCategoryMask); }

inline bool is_letter(Category c) { return c >= Category::Lu && c <= Category::Lo; }
inline bool is_mark(Category c) { return c >= Category::Mn && c <= Category::Me; }
inline bool is_number(Category c) { return c >= Category::Nd && c <= Category::No; }
inline bool is_punctuation(Category c) { return c >= Category::Pc && c <= Category::Po; }
inline bool is_symbol(Category c) { return c >= Category::Sm && c <= Category::So; }

// The code point starting at text[pos] (valid UTF-8 expected), and its length in bytes in *length. Malformed UTF-8
// is an error naming the byte offset.
char32_t decode_utf8(std::string_view text, size_t pos, int* length);
void append_utf8(char32_t cp, std::string& out);

// The Unicode version of the tables ("14.0.0").
const char* unicode_version();

// True when `text` is certainly NFC already (no code point of it can change or combine); ASCII is.
bool is_nfc_quick(std::string_view text);
// NFC of `text` (canonical decomposition, canonical ordering, canonical composition; Hangul algorithmic).
std::string nfc(std::string_view text);

}  // namespace moetrain::train::data::unicode
