// defines: prepare_dataset, the body of `moetrain data prepare`: turns JSONL token ids, JSONL text
// or plain-text files into an indexed dataset (prefix.idx + prefix.bin), one document per
// sequence, each ending with the end-of-document token.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train/data/indexed_dataset.h"

namespace moetrain::train::data {

struct PrepareOptions {
  std::string output;  // prefix: writes output.idx and output.bin (parent folders are created)
  // JSONL input, one document per line: token ids in `field` (an array of integers >= 0; `eod`
  // required, appended to every document), or, when `text_field` is set, text in that field,
  // byte-tokenised with kByteEod appended.
  std::string input;
  std::string field = "tokens";
  std::string text_field;
  // Plain-text input (instead of `input`): every paragraph (lines up to a blank line) of every
  // file is a document, byte-tokenised, kByteEod appended.
  std::vector<std::string> text_files;
  std::optional<int64_t> eod;  // token-id JSONL only
  std::string dtype = "auto";  // auto (uint16 when every id < 65536, else int32) | uint16 | int32
};

struct PrepareSummary {
  int64_t documents = 0;      // written, EOD included in each
  int64_t tokens = 0;         // written, EODs included
  int64_t skipped_empty = 0;  // documents with no tokens before the EOD (not written)
  int64_t max_id = 0;
  IndexDType dtype = IndexDType::UInt16;
  std::string idx_path;
  std::string bin_path;
};

// Reads and validates every input first and writes only then (atomically, see
// IndexedDatasetBuilder), so bad input leaves no output files. Errors name the file and the line:
// a line that is not JSON or not an object, a missing field, a field of the wrong type, a
// negative id, an id the dtype cannot hold, an input with no documents.
PrepareSummary prepare_dataset(const PrepareOptions& options);

}  // namespace moetrain::train::data
