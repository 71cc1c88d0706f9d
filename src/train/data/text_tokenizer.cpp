// defines: byte-level encode and decode.
#include "train/data/text_tokenizer.h"

#include "core/error.h"

namespace moetrain::train::data {

std::vector<int32_t> byte_encode(std::string_view text) {
  std::vector<int32_t> ids;
  byte_encode_append(text, ids);
  return ids;
}

void byte_encode_append(std::string_view text, std::vector<int32_t>& out) {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<int32_t>(static_cast<unsigned char>(c)));
}

std::string byte_decode(std::span<const int32_t> ids) {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    MT_CHECK(id >= 0 && id < kByteVocab, "byte tokenizer: id {} at position {} is outside the byte vocabulary [0, {})",
             id, i, kByteVocab);
    if (id == kByteEod) {
      text += "\n<eod>\n";
    } else {
      text += static_cast<char>(static_cast<unsigned char>(id));
    }
  }
  return text;
}

}  // namespace moetrain::train::data
