// defines: reading (with full validation of the index) and writing of Megatron-LM indexed
// datasets. All integers are little-endian; the index arrays are read with memcpy because they
// follow a 34-byte header and are not aligned.
#include "train/data/indexed_dataset.h"

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>
#include <utility>

#include <unistd.h>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/mapped_file.h"

namespace moetrain::train::data {

static_assert(std::endian::native == std::endian::little, "indexed datasets are little-endian; so is this reader");

namespace fs = std::filesystem;

namespace {

template <typename T>
T load(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

std::string hex_bytes(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += fmt::format("{}{:02x}", i == 0 ? "" : " ", p[i]);
  return out;
}

std::string errno_text(int error) { return std::system_category().message(error); }

void require_file(const std::string& path, const std::string& prefix) {
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(path, ec),
           "indexed dataset {}: {} does not exist (expected {}.idx and {}.bin, as "
           "written by `moetrain data prepare`)",
           prefix, path, prefix, prefix);
}

// Converts `count` stored tokens of type T at `src` to int32, failing on values int32 cannot hold.
template <typename T>
void convert(const uint8_t* src, int64_t count, int32_t* out, const IndexedDataset& dataset, int64_t sequence,
             int64_t offset) {
  for (int64_t k = 0; k < count; ++k) {
    const T value = load<T>(src + k * static_cast<int64_t>(sizeof(T)));
    if constexpr (sizeof(T) >= sizeof(int32_t) && !std::is_same_v<T, int32_t>) {
      MT_CHECK(value >= static_cast<T>(std::numeric_limits<int32_t>::min()) &&
                   value <= static_cast<T>(std::numeric_limits<int32_t>::max()),
               "{}: sequence {} token {} is {}, which does not fit a 32-bit token id", dataset.bin_path(), sequence,
               offset + k, value);
    }
    out[k] = static_cast<int32_t>(value);
  }
}

}  // namespace

size_t index_dtype_size(IndexDType dtype) {
  switch (dtype) {
    case IndexDType::UInt8: return 1;
    case IndexDType::Int8: return 1;
    case IndexDType::Int16: return 2;
    case IndexDType::Int32: return 4;
    case IndexDType::Int64: return 8;
    case IndexDType::Float64: return 8;
    case IndexDType::Float32: return 4;
    case IndexDType::UInt16: return 2;
  }
  MT_FAIL("indexed dataset: unknown dtype code {}", static_cast<int>(dtype));
}

std::string_view index_dtype_name(IndexDType dtype) {
  switch (dtype) {
    case IndexDType::UInt8: return "uint8";
    case IndexDType::Int8: return "int8";
    case IndexDType::Int16: return "int16";
    case IndexDType::Int32: return "int32";
    case IndexDType::Int64: return "int64";
    case IndexDType::Float64: return "float64";
    case IndexDType::Float32: return "float32";
    case IndexDType::UInt16: return "uint16";
  }
  return "unknown";
}

std::optional<IndexDType> index_dtype_from_code(uint8_t code) {
  if (code < 1 || code > 8) return std::nullopt;
  return static_cast<IndexDType>(code);
}

std::optional<IndexDType> index_dtype_from_name(std::string_view name) {
  for (uint8_t code = 1; code <= 8; ++code) {
    const auto dtype = static_cast<IndexDType>(code);
    if (index_dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

IndexDType index_dtype_for_max_id(int64_t max_id) { return max_id < 65536 ? IndexDType::UInt16 : IndexDType::Int32; }

// ---------------------------------------------------------------------------------------------
// Reading

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.prefix_ = prefix;
  const std::string idx_path = ds.idx_path(), bin_path = ds.bin_path();
  require_file(idx_path, prefix);
  require_file(bin_path, prefix);
  ds.idx_ = io::MappedFile::open(idx_path);
  ds.bin_ = io::MappedFile::open(bin_path);

  const uint8_t* idx = ds.idx_->data();
  const size_t idx_size = ds.idx_->size();
  MT_CHECK(idx_size >= kIndexHeaderBytes, "{}: the file has {} bytes, fewer than the {}-byte MMIDIDX header", idx_path,
           idx_size, kIndexHeaderBytes);
  MT_CHECK(std::memcmp(idx, kIndexMagic.data(), kIndexMagic.size()) == 0,
           "{}: bad magic: expected \"MMIDIDX\\0\\0\" (4d 4d 49 44 49 44 58 00 00, a Megatron indexed dataset) but "
           "found {}",
           idx_path, hex_bytes(idx, kIndexMagic.size()));
  const uint64_t version = load<uint64_t>(idx + 9);
  MT_CHECK(version == kIndexVersion, "{}: unsupported version {} (expected {})", idx_path, version, kIndexVersion);
  const uint8_t code = idx[17];
  const std::optional<IndexDType> dtype = index_dtype_from_code(code);
  MT_CHECK(dtype.has_value(),
           "{}: unknown dtype code {} (expected 1..8: uint8, int8, int16, int32, int64, float64, "
           "float32, uint16)",
           idx_path, code);
  ds.dtype_ = *dtype;
  const uint64_t n = load<uint64_t>(idx + 18);
  const uint64_t d = load<uint64_t>(idx + 26);

  // The counts decide the file size exactly: header + int32 sizes[N] + int64 pointers[N] + int64 docs[D].
  // Counts up to 2^58 keep the byte count below 2^63; larger ones cannot describe any real file.
  constexpr uint64_t kMaxCount = uint64_t{1} << 58;
  const bool representable = n <= kMaxCount && d <= kMaxCount;
  const uint64_t needed = representable ? kIndexHeaderBytes + n * 12 + d * 8 : 0;
  MT_CHECK(representable && needed == idx_size,
           "{}: the header's counts ({} sequences, {} document indices) need {} bytes but the file has {} bytes",
           idx_path, n, d, representable ? fmt::format("{}", needed) : std::string("more than 2^61"), idx_size);
  ds.num_sequences_ = static_cast<int64_t>(n);
  ds.sizes_ = idx + kIndexHeaderBytes;
  ds.pointers_ = ds.sizes_ + n * 4;
  const uint8_t* docs = ds.pointers_ + n * 8;

  const uint64_t element = index_dtype_size(ds.dtype_);
  const uint64_t bin_size = ds.bin_->size();
  uint64_t expected_pointer = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const int32_t size = load<int32_t>(ds.sizes_ + i * 4);
    MT_CHECK(size >= 0, "{}: sizes[{}] is {} (expected a token count >= 0)", idx_path, i, size);
    const int64_t pointer = load<int64_t>(ds.pointers_ + i * 8);
    MT_CHECK(pointer >= 0 && static_cast<uint64_t>(pointer) == expected_pointer,
             "{}: pointers[{}] is {} but the sizes before it give byte offset {} ({}, {} bytes per token)", idx_path, i,
             pointer, expected_pointer, index_dtype_name(ds.dtype_), element);
    const uint64_t end = expected_pointer + static_cast<uint64_t>(size) * element;
    MT_CHECK(end <= bin_size,
             "{}: sequence {} ends at byte {} but the file has {} bytes (the .idx says more tokens "
             "than the .bin holds)",
             bin_path, i, end, bin_size);
    expected_pointer = end;  // <= bin_size, so the running sum never overflows
    ds.total_tokens_ += size;
  }

  MT_CHECK(d >= 1, "{}: document_indices is empty (expected at least the entries 0 and {})", idx_path, n);
  ds.document_indices_.resize(d);
  for (uint64_t k = 0; k < d; ++k) {
    const int64_t start = load<int64_t>(docs + k * 8);
    ds.document_indices_[k] = start;
    if (k == 0) {
      MT_CHECK(start == 0, "{}: document_indices[0] is {} (expected 0)", idx_path, start);
    } else {
      MT_CHECK(start >= ds.document_indices_[k - 1],
               "{}: document_indices decrease: entry [{}] = {} follows entry [{}] = {} (expected non-decreasing)",
               idx_path, k, start, k - 1, ds.document_indices_[k - 1]);
    }
  }
  MT_CHECK(ds.document_indices_.back() == static_cast<int64_t>(n),
           "{}: the last document_indices entry [{}] is {} (expected the sequence count {})", idx_path, d - 1,
           ds.document_indices_.back(), n);
  return ds;
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  MT_CHECK(i >= 0 && i < num_sequences_, "{}: sequence index {} is outside [0, {})", idx_path(), i, num_sequences_);
  return load<int32_t>(sizes_ + i * 4);
}

std::vector<int32_t> IndexedDataset::read(int64_t i) const {
  std::vector<int32_t> out(static_cast<size_t>(sequence_length(i)));
  read(i, 0, static_cast<int64_t>(out.size()), out.data());
  return out;
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t count, int32_t* out) const {
  const int64_t length = sequence_length(i);
  MT_CHECK(offset >= 0 && count >= 0 && offset + count <= length,
           "{}: read of tokens [{}, {}) of sequence {} which has {} tokens", bin_path(), offset, offset + count, i,
           length);
  if (count == 0) return;
  const int64_t element = static_cast<int64_t>(index_dtype_size(dtype_));
  const uint8_t* src = bin_->data() + load<int64_t>(pointers_ + i * 8) + offset * element;
  switch (dtype_) {
    case IndexDType::UInt8: return convert<uint8_t>(src, count, out, *this, i, offset);
    case IndexDType::Int8: return convert<int8_t>(src, count, out, *this, i, offset);
    case IndexDType::Int16: return convert<int16_t>(src, count, out, *this, i, offset);
    case IndexDType::Int32: return convert<int32_t>(src, count, out, *this, i, offset);
    case IndexDType::Int64: return convert<int64_t>(src, count, out, *this, i, offset);
    case IndexDType::UInt16: return convert<uint16_t>(src, count, out, *this, i, offset);
    case IndexDType::Float64:
    case IndexDType::Float32: break;
  }
  MT_FAIL("{}: tokens are stored as {}, which holds no token ids (expected an integer dtype such as uint16 or int32)",
          bin_path(), index_dtype_name(dtype_));
}

// ---------------------------------------------------------------------------------------------
// Writing

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string prefix, IndexDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  MT_CHECK(index_dtype_from_code(static_cast<uint8_t>(dtype)).has_value(),
           "indexed dataset builder {}: unknown dtype code {}", prefix_, static_cast<int>(dtype));
  MT_CHECK(dtype != IndexDType::Float32 && dtype != IndexDType::Float64,
           "indexed dataset builder {}: dtype {} cannot store token ids (expected an integer dtype such as uint16 or "
           "int32)",
           prefix_, index_dtype_name(dtype));
  const int fd = io::create_temporary_beside(prefix_ + ".bin", &bin_tmp_);
  bin_ = ::fdopen(fd, "wb");
  if (bin_ == nullptr) {
    const int error = errno;
    ::close(fd);
    ::unlink(bin_tmp_.c_str());
    MT_FAIL("indexed dataset builder: cannot open {}: {}", bin_tmp_, errno_text(error));
  }
}

namespace {

IndexDType builder_dtype(const std::string& prefix, int code) {
  MT_CHECK(code >= 1 && code <= 8,
           "indexed dataset builder {}: unknown dtype code {} (expected 1..8, e.g. 8 for uint16 "
           "or 4 for int32)",
           prefix, code);
  return static_cast<IndexDType>(code);
}

}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(const std::string& prefix, int dtype_code)
    : IndexedDatasetBuilder(prefix, builder_dtype(prefix, dtype_code)) {}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (bin_ != nullptr) std::fclose(bin_);
  if (!finished_) {
    std::error_code ec;  // best effort: a destructor cannot report
    if (!bin_tmp_.empty()) fs::remove(bin_tmp_, ec);
    if (!idx_tmp_.empty()) fs::remove(idx_tmp_, ec);
  }
}

template <typename T>
void IndexedDatasetBuilder::append(std::span<const T> tokens) {
  MT_CHECK(!finished_, "indexed dataset builder {}: add_sequence after finish()", prefix_);
  MT_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
           "indexed dataset builder {}: a sequence of {} tokens exceeds the format's int32 size", prefix_,
           tokens.size());
  int64_t lo = 0, hi = 0;
  switch (dtype_) {
    case IndexDType::UInt8: hi = 255; break;
    case IndexDType::Int8: lo = -128, hi = 127; break;
    case IndexDType::Int16: lo = -32768, hi = 32767; break;
    case IndexDType::Int32: lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max(); break;
    case IndexDType::Int64: lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max(); break;
    case IndexDType::UInt16: hi = 65535; break;
    case IndexDType::Float64:
    case IndexDType::Float32: break;
  }
  const size_t element = index_dtype_size(dtype_);
  buffer_.resize(tokens.size() * element);
  for (size_t k = 0; k < tokens.size(); ++k) {
    const int64_t id = tokens[k];
    MT_CHECK(id >= lo && id <= hi,
             "indexed dataset builder {}: token id {} (sequence {}, token {}) does not fit the "
             "stored dtype {} (range [{}, {}])",
             prefix_, id, sizes_.size(), k, index_dtype_name(dtype_), lo, hi);
    uint8_t* dst = buffer_.data() + k * element;
    switch (dtype_) {
      case IndexDType::UInt8: *dst = static_cast<uint8_t>(id); break;
      case IndexDType::Int8: *dst = static_cast<uint8_t>(static_cast<int8_t>(id)); break;
      case IndexDType::Int16: {
        const auto v = static_cast<int16_t>(id);
        std::memcpy(dst, &v, 2);
        break;
      }
      case IndexDType::UInt16: {
        const auto v = static_cast<uint16_t>(id);
        std::memcpy(dst, &v, 2);
        break;
      }
      case IndexDType::Int32: {
        const auto v = static_cast<int32_t>(id);
        std::memcpy(dst, &v, 4);
        break;
      }
      case IndexDType::Int64: std::memcpy(dst, &id, 8); break;
      case IndexDType::Float64:
      case IndexDType::Float32: break;
    }
  }
  const size_t written = buffer_.empty() ? 0 : std::fwrite(buffer_.data(), 1, buffer_.size(), bin_);
  MT_CHECK(written == buffer_.size(), "indexed dataset builder: cannot write {}.bin.tmp: {}", prefix_,
           errno_text(errno));
  sizes_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetBuilder::add_sequence(std::span<const int32_t> tokens) { append(tokens); }
void IndexedDatasetBuilder::add_sequence(std::span<const int64_t> tokens) { append(tokens); }

void IndexedDatasetBuilder::finish() {
  MT_CHECK(!finished_, "indexed dataset builder {}: finish() called twice", prefix_);
  const std::string& bin_tmp = bin_tmp_;
  const int closed = std::fclose(bin_);
  bin_ = nullptr;
  MT_CHECK(closed == 0, "indexed dataset builder: cannot write {}: {}", bin_tmp, errno_text(errno));

  const uint64_t n = sizes_.size();
  std::vector<uint8_t> index;
  index.reserve(kIndexHeaderBytes + n * 20 + 8);
  auto put = [&index](const auto& value) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
    index.insert(index.end(), bytes, bytes + sizeof(value));
  };
  index.insert(index.end(), kIndexMagic.begin(), kIndexMagic.end());
  put(kIndexVersion);
  put(static_cast<uint8_t>(dtype_));
  put(n);
  put(static_cast<uint64_t>(n + 1));  // document_indices: every sequence is one document
  for (int32_t size : sizes_) put(size);
  int64_t pointer = 0;
  for (int32_t size : sizes_) {
    put(pointer);
    pointer += static_cast<int64_t>(size) * static_cast<int64_t>(index_dtype_size(dtype_));
  }
  for (uint64_t k = 0; k <= n; ++k) put(static_cast<int64_t>(k));

  const int idx_fd = io::create_temporary_beside(prefix_ + ".idx", &idx_tmp_);
  const std::string& idx_tmp = idx_tmp_;
  std::FILE* idx = ::fdopen(idx_fd, "wb");
  if (idx == nullptr) ::close(idx_fd);
  MT_CHECK(idx != nullptr, "indexed dataset builder: cannot open {}: {}", idx_tmp, errno_text(errno));
  const size_t written = std::fwrite(index.data(), 1, index.size(), idx);
  const int idx_closed = std::fclose(idx);
  MT_CHECK(written == index.size() && idx_closed == 0, "indexed dataset builder: cannot write {}: {}", idx_tmp,
           errno_text(errno));

  // The .bin goes first: a reader that finds the new .idx also finds the .bin it describes.
  std::error_code ec;
  fs::rename(bin_tmp, prefix_ + ".bin", ec);
  MT_CHECK(!ec, "indexed dataset builder: cannot rename {} to {}.bin: {}", bin_tmp, prefix_, ec.message());
  fs::rename(idx_tmp, prefix_ + ".idx", ec);
  MT_CHECK(!ec, "indexed dataset builder: cannot rename {} to {}.idx: {}", idx_tmp, prefix_, ec.message());
  finished_ = true;
}

}  // namespace moetrain::train::data
