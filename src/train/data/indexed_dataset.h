// defines: IndexedDataset and IndexedDatasetBuilder, the Megatron-LM indexed dataset (MMIDIDX):
// prefix.idx holds the sequence sizes and byte offsets, prefix.bin the raw tokens. Most corpora
// are tokenised into this format; the loader reads documents from it through a memory map.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain::io {
class MappedFile;
}

namespace moetrain::train::data {

// The dtype codes of the .idx header (Megatron's DType enum).
enum class IndexDType : uint8_t {
  UInt8 = 1,
  Int8 = 2,
  Int16 = 3,
  Int32 = 4,
  Int64 = 5,
  Float64 = 6,
  Float32 = 7,
  UInt16 = 8,
};

// Bytes per token of `dtype`.
size_t index_dtype_size(IndexDType dtype);
std::string_view index_dtype_name(IndexDType dtype);  // "uint16", "int32", ...
// The dtype named `name` ("uint8", ..., "uint16"), or nullopt when the name is unknown.
std::optional<IndexDType> index_dtype_from_name(std::string_view name);
// The dtype of code `code`, or nullopt when the code is not one of 1..8.
std::optional<IndexDType> index_dtype_from_code(uint8_t code);
// The smallest usual choice for token ids up to `max_id`: uint16 when max_id < 65536, else int32.
IndexDType index_dtype_for_max_id(int64_t max_id);

// "MMIDIDX\0\0", the .idx header's first 9 bytes.
inline constexpr std::string_view kIndexMagic{"MMIDIDX\0\0", 9};
inline constexpr uint64_t kIndexVersion = 1;
// magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8).
inline constexpr size_t kIndexHeaderBytes = 34;

// A read-only view of prefix.idx + prefix.bin. open() validates the whole index (see the .cpp),
// so every later read stays inside the mapped files. Copies share the maps.
class IndexedDataset {
 public:
  static IndexedDataset open(const std::string& prefix);

  const std::string& path() const { return prefix_; }  // the prefix given to open()
  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  IndexDType dtype() const { return dtype_; }

  int64_t num_sequences() const { return num_sequences_; }
  int64_t sequence_length(int64_t i) const;  // tokens of sequence i
  int64_t total_tokens() const { return total_tokens_; }
  // document_indices[k]: the sequence where document k starts (num_documents() + 1 entries).
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  const std::vector<int64_t>& document_indices() const { return document_indices_; }

  // Sequence i as int32 ids. Float dtypes and values outside int32 are errors that name the
  // file, the sequence and the value.
  std::vector<int32_t> read(int64_t i) const;
  // Tokens [offset, offset + count) of sequence i into out[0, count).
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const;

 private:
  IndexedDataset() = default;

  std::string prefix_;
  IndexDType dtype_ = IndexDType::UInt16;
  int64_t num_sequences_ = 0;
  int64_t total_tokens_ = 0;
  std::shared_ptr<io::MappedFile> idx_;
  std::shared_ptr<io::MappedFile> bin_;
  const uint8_t* sizes_ = nullptr;     // int32[N] inside idx_ (not aligned: read with memcpy)
  const uint8_t* pointers_ = nullptr;  // int64[N] inside idx_
  std::vector<int64_t> document_indices_;
};

// Writes an indexed dataset, one document per sequence: tokens stream into a new "<prefix>.bin.tmp-<pid>-<n>"
// (io/atomic_file.h: created exclusively, never through a symlink); finish() writes the .idx the same way and renames
// both into place, so readers never see a partial dataset. A builder destroyed before finish() removes its
// temporary files.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::string prefix, IndexDType dtype);
  // The same with the .idx dtype code (1..8, e.g. 8 for uint16, 4 for int32).
  IndexedDatasetBuilder(const std::string& prefix, int dtype_code);
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;
  ~IndexedDatasetBuilder();

  // Appends one sequence. An id the dtype cannot hold (negative for unsigned, too large) is an
  // error naming the id and the dtype; nothing is appended then.
  void add_sequence(std::span<const int32_t> tokens);
  void add_sequence(std::span<const int64_t> tokens);
  void finish();

  int64_t num_sequences() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  template <typename T>
  void append(std::span<const T> tokens);

  std::string prefix_;
  IndexDType dtype_;
  std::FILE* bin_ = nullptr;
  std::string bin_tmp_, idx_tmp_;  // the temporary files' names
  std::vector<int32_t> sizes_;
  std::vector<uint8_t> buffer_;
  int64_t num_tokens_ = 0;
  bool finished_ = false;
};

}  // namespace moetrain::train::data
