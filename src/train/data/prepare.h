// defines: prepare_dataset, the body of `moetrain data prepare`: turns JSONL token ids, JSONL text
// (byte-tokenised, or BPE-encoded with a Hugging Face tokenizer.json) or plain-text files into an
// indexed dataset (prefix.idx + prefix.bin), one document per sequence, each ending with the
// end-of-document token.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "train/data/indexed_dataset.h"

namespace moetrain::train::data {

// Where a tokenizer run stands, reported now and then while it streams.
struct PrepareProgress {
  int64_t documents = 0;    // written so far
  int64_t tokens = 0;       // written so far, EODs included
  int64_t input_bytes = 0;  // of the input consumed so far
  double seconds = 0;       // since the start
  bool final = false;       // the last report, once everything is written
};

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
  std::optional<int64_t> eod;  // token-id JSONL, or with `tokenizer` (else the tokenizer's own: choose_eod)
  std::string dtype = "auto";  // auto (uint16 when every id < 65536, else int32) | uint16 | int32
  // A tokenizer.json (or a folder holding one): JSONL text in `text_field` ("text" when empty) is encoded with it
  // (train/data/bpe_tokenizer.h) on `threads` workers (0: one per hardware thread), streaming, documents written in
  // input order. With auto dtype the dtype follows the tokenizer's id count, so one pass suffices.
  std::string tokenizer;
  int threads = 0;
  std::function<void(const PrepareProgress&)> progress;  // tokenizer runs: called every ~0.5 s and at the end
};

struct PrepareSummary {
  int64_t documents = 0;      // written, EOD included in each
  int64_t tokens = 0;         // written, EODs included
  int64_t skipped_empty = 0;  // documents with no tokens before the EOD (not written)
  int64_t max_id = 0;
  IndexDType dtype = IndexDType::UInt16;
  std::string idx_path;
  std::string bin_path;
  // Tokenizer runs only.
  int64_t eod = -1;
  std::string eod_source;      // where the EOD id came from (choose_eod)
  std::string tokenizer;       // BpeTokenizer::describe()
  std::string tokenizer_note;  // BpeTokenizer::post_processor_note()
  int64_t input_bytes = 0;
  double seconds = 0;
};

// Reads and validates every input first and writes only then (atomically, see
// IndexedDatasetBuilder), so bad input leaves no output files. Errors name the file and the line:
// a line that is not JSON or not an object, a missing field, a field of the wrong type, a
// negative id, an id the dtype cannot hold, an input with no documents.
PrepareSummary prepare_dataset(const PrepareOptions& options);

// prepare_dataset with options.tokenizer set (prepare_tokenized.cpp): streams instead of reading twice, so output
// goes to temporary files that an error removes, with any output folder it created; nothing is left behind either.
PrepareSummary prepare_tokenized(const PrepareOptions& options);

}  // namespace moetrain::train::data
