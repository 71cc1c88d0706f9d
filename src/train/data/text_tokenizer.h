// defines: the byte-level tokenizer of the demos: the UTF-8 bytes of a text are its token ids
// (0..255), 256 ends a document, so the vocabulary has 257 entries and needs no files.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain::train::data {

inline constexpr int32_t kByteEod = 256;    // end of document
inline constexpr int64_t kByteVocab = 257;  // 256 bytes + EOD

// The bytes of `text` as ids 0..255 (no EOD appended).
std::vector<int32_t> byte_encode(std::string_view text);
// Appends the ids of `text` to `out`.
void byte_encode_append(std::string_view text, std::vector<int32_t>& out);
// The text of `ids` for printing samples: bytes as they are, EOD as "\n<eod>\n". An id outside
// [0, 257) is an error naming the id and its position.
std::string byte_decode(std::span<const int32_t> ids);

}  // namespace moetrain::train::data
