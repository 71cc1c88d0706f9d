// defines: the generated Unicode tables (unicode_tables.cpp, made by scripts/gen_unicode_tables.py from Python's
// unicodedata) that the tokenizer's character classes and NFC normaliser read through train/data/unicode.h.
#pragma once

#include <cstdint>

namespace moetrain::train::data::unicode {

// [first, last] with one value (a general category index into kCategoryNames, or a combining class).
struct CategoryRange {
  char32_t first;
  char32_t last;
  uint8_t value;
};
struct CodeRange {
  char32_t first;
  char32_t last;
};
// The full canonical decomposition of `code_point`: kDecompositionData[offset, offset + length).
struct Decomposition {
  char32_t code_point;
  uint16_t offset;
  uint8_t length;
};
// first + second compose to `composite` (a primary composite).
struct Composition {
  char32_t first;
  char32_t second;
  char32_t composite;
};

extern const char* const kUnicodeVersion;
extern const CategoryRange kCategoryRanges[];  // sorted, disjoint; code points not covered are Cn
extern const int kCategoryRangeCount;
extern const CodeRange kWhiteSpace[];
extern const int kWhiteSpaceCount;
extern const CodeRange kAlphabetic[];
extern const int kAlphabeticCount;
extern const CategoryRange kCombiningClassRanges[];  // non-zero classes only
extern const int kCombiningClassRangeCount;
extern const Decomposition kDecompositions[];  // sorted by code point; Hangul syllables are algorithmic
extern const int kDecompositionCount;
extern const char32_t kDecompositionData[];
extern const Composition kCompositions[];  // sorted by (first, second)
extern const int kCompositionCount;
extern const CodeRange kNfcUnstable[];  // a text holding none of these is already NFC
extern const int kNfcUnstableCount;

}  // namespace moetrain::train::data::unicode
