// Tests for train/data/indexed_dataset: builder round trips, a hand-written MMIDIDX file read as
// the format says, and one test per kind of corrupt index or missing file.
#include "train/data/indexed_dataset.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "core/error.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::train::data {
namespace {

using testing::expect_error;

namespace fs = std::filesystem;

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

template <typename T>
void put_le(std::vector<uint8_t>& bytes, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) bytes.push_back(static_cast<uint8_t>(static_cast<uint64_t>(value) >> (8 * i)));
}

// The fields of an .idx file, written byte by byte as the format describes them. Counts default
// to the arrays' sizes; overriding them makes the header disagree with the file.
struct RawIndex {
  std::string magic{"MMIDIDX\0\0", 9};
  uint64_t version = 1;
  uint8_t dtype_code = 8;
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers;
  std::vector<int64_t> document_indices;
  std::optional<uint64_t> sequence_count;
  std::optional<uint64_t> document_count;
  size_t trailing_bytes = 0;

  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out(magic.begin(), magic.end());
    put_le(out, version);
    out.push_back(dtype_code);
    put_le(out, sequence_count.value_or(sizes.size()));
    put_le(out, document_count.value_or(document_indices.size()));
    for (int32_t s : sizes) put_le(out, s);
    for (int64_t p : pointers) put_le(out, p);
    for (int64_t d : document_indices) put_le(out, d);
    out.resize(out.size() + trailing_bytes, 0);
    return out;
  }
};

// A valid uint16 index of three sequences (3, 0 and 2 tokens) and its .bin.
RawIndex valid_index() {
  RawIndex raw;
  raw.sizes = {3, 0, 2};
  raw.pointers = {0, 6, 6};
  raw.document_indices = {0, 1, 2, 3};
  return raw;
}

std::string write_dataset(const std::string& dir, const RawIndex& raw, size_t bin_bytes = 10) {
  const std::string prefix = dir + "/corpus";
  write_bytes(prefix + ".idx", raw.bytes());
  std::vector<uint8_t> bin(bin_bytes);
  for (size_t i = 0; i < bin.size(); ++i) bin[i] = static_cast<uint8_t>(i + 1);
  write_bytes(prefix + ".bin", bin);
  return prefix;
}

void expect_corrupt(const RawIndex& raw, std::initializer_list<std::string_view> words, size_t bin_bytes = 10) {
  const std::string prefix = write_dataset(testing::make_temp_dir("idx_corrupt"), raw, bin_bytes);
  expect_error([&] { IndexedDataset::open(prefix); }, words);
}

// ---- round trips ----

void expect_round_trip(IndexDType dtype, const std::vector<std::vector<int32_t>>& sequences) {
  const std::string prefix = testing::make_temp_dir("idx_round_trip") + "/corpus";
  IndexedDatasetBuilder builder(prefix, dtype);
  for (const auto& sequence : sequences) builder.add_sequence(sequence);
  builder.finish();
  // Only the two files: no temporary file is left behind.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(fs::path(prefix).parent_path()))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"corpus.bin", "corpus.idx"}));

  const IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.path(), prefix);
  EXPECT_EQ(ds.dtype(), dtype);
  ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(sequences.size()));
  EXPECT_EQ(ds.num_documents(), static_cast<int64_t>(sequences.size()));
  int64_t total = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    EXPECT_EQ(ds.sequence_length(static_cast<int64_t>(i)), static_cast<int64_t>(sequences[i].size()));
    EXPECT_EQ(ds.read(static_cast<int64_t>(i)), sequences[i]) << "sequence " << i;
    total += static_cast<int64_t>(sequences[i].size());
  }
  EXPECT_EQ(ds.total_tokens(), total);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), static_cast<uintmax_t>(total) * index_dtype_size(dtype));
}

TEST(IndexedDataset, RoundTripsUint16) {
  expect_round_trip(IndexDType::UInt16, {{0, 1, 65535, 256}, {}, {7}, {65534, 3, 3, 3, 3, 9}});
}

TEST(IndexedDataset, RoundTripsInt32) {
  expect_round_trip(IndexDType::Int32, {{70000, 1 << 30, 0}, {2147483647}, {}, {5, 6}});
}

TEST(IndexedDataset, ReadsARangeOfASequence) {
  const std::string prefix = testing::make_temp_dir("idx_range") + "/corpus";
  IndexedDatasetBuilder builder(prefix, IndexDType::UInt16);
  builder.add_sequence(std::vector<int32_t>{10, 11, 12, 13, 14});
  builder.finish();
  const IndexedDataset ds = IndexedDataset::open(prefix);
  std::vector<int32_t> out(3);
  ds.read(0, 1, 3, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{11, 12, 13}));
  expect_error([&] { ds.read(0, 3, 3, out.data()); }, {"tokens [3, 6)", "5 tokens"});
  expect_error([&] { ds.sequence_length(1); }, {"sequence index 1", "[0, 1)"});
}

TEST(IndexedDataset, ReadsAHandWrittenFileAsTheFormatSays) {
  // uint16 tokens; 3 sequences in 2 documents (document_indices 0, 2, 3).
  RawIndex raw;
  raw.sizes = {2, 1, 3};
  raw.pointers = {0, 4, 6};
  raw.document_indices = {0, 2, 3};
  const std::string dir = testing::make_temp_dir("idx_hand");
  write_bytes(dir + "/hand.idx", raw.bytes());
  write_bytes(dir + "/hand.bin", {0x01, 0x00, 0xff, 0xff, 0x00, 0x01, 0x34, 0x12, 0x00, 0x00, 0x02, 0x80});
  const IndexedDataset ds = IndexedDataset::open(dir + "/hand");
  EXPECT_EQ(ds.path(), dir + "/hand");
  EXPECT_EQ(ds.dtype(), IndexDType::UInt16);
  ASSERT_EQ(ds.num_sequences(), 3);
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(ds.sequence_length(0), 2);
  EXPECT_EQ(ds.sequence_length(1), 1);
  EXPECT_EQ(ds.sequence_length(2), 3);
  EXPECT_EQ(ds.read(0), (std::vector<int32_t>{1, 65535}));
  EXPECT_EQ(ds.read(1), (std::vector<int32_t>{256}));
  EXPECT_EQ(ds.read(2), (std::vector<int32_t>{0x1234, 0, 0x8002}));
}

TEST(IndexedDataset, ConvertsSignedStoredDtypes) {
  RawIndex raw;
  raw.dtype_code = 2;  // int8
  raw.sizes = {3};
  raw.pointers = {0};
  raw.document_indices = {0, 1};
  const std::string prefix = testing::make_temp_dir("idx_int8") + "/corpus";
  write_bytes(prefix + ".idx", raw.bytes());
  write_bytes(prefix + ".bin", {0x05, 0xff, 0x80});
  EXPECT_EQ(IndexedDataset::open(prefix).read(0), (std::vector<int32_t>{5, -1, -128}));
}

TEST(IndexedDataset, RejectsInt64ValuesOutsideInt32) {
  RawIndex raw;
  raw.dtype_code = 5;  // int64
  raw.sizes = {2};
  raw.pointers = {0};
  raw.document_indices = {0, 1};
  const std::string prefix = testing::make_temp_dir("idx_int64") + "/corpus";
  write_bytes(prefix + ".idx", raw.bytes());
  std::vector<uint8_t> bin;
  put_le(bin, int64_t{7});
  put_le(bin, int64_t{1} << 40);
  write_bytes(prefix + ".bin", bin);
  const IndexedDataset ds = IndexedDataset::open(prefix);
  expect_error([&] { ds.read(0); }, {prefix + ".bin", "sequence 0 token 1", "1099511627776", "32-bit"});
}

TEST(IndexedDataset, RejectsReadingFloatTokens) {
  RawIndex raw;
  raw.dtype_code = 7;  // float32
  raw.sizes = {1};
  raw.pointers = {0};
  raw.document_indices = {0, 1};
  const std::string prefix = testing::make_temp_dir("idx_float") + "/corpus";
  write_bytes(prefix + ".idx", raw.bytes());
  write_bytes(prefix + ".bin", {0, 0, 0x80, 0x3f});
  const IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.sequence_length(0), 1);
  expect_error([&] { ds.read(0); }, {prefix + ".bin", "float32", "integer dtype"});
}

// ---- corrupt or missing files ----

TEST(IndexedDataset, RejectsMissingIdx) {
  const std::string prefix = testing::make_temp_dir("idx_missing") + "/corpus";
  write_bytes(prefix + ".bin", {1, 0});
  expect_error([&] { IndexedDataset::open(prefix); }, {prefix + ".idx", "does not exist"});
}

TEST(IndexedDataset, RejectsMissingBin) {
  const std::string dir = testing::make_temp_dir("idx_missing");
  const std::string prefix = write_dataset(dir, valid_index());
  fs::remove(prefix + ".bin");
  expect_error([&] { IndexedDataset::open(prefix); }, {prefix + ".bin", "does not exist"});
}

TEST(IndexedDataset, RejectsIndexShorterThanHeader) {
  const std::string prefix = testing::make_temp_dir("idx_short") + "/corpus";
  write_bytes(prefix + ".idx", {'M', 'M', 'I', 'D'});
  write_bytes(prefix + ".bin", {});
  expect_error([&] { IndexedDataset::open(prefix); }, {prefix + ".idx", "4 bytes", "34-byte"});
}

TEST(IndexedDataset, RejectsBadMagic) {
  RawIndex raw = valid_index();
  raw.magic = std::string("MMIDIDY\0\0", 9);
  expect_corrupt(raw, {"corpus.idx", "bad magic", "4d 4d 49 44 49 44 59 00 00"});
}

TEST(IndexedDataset, RejectsUnsupportedVersion) {
  RawIndex raw = valid_index();
  raw.version = 2;
  expect_corrupt(raw, {"corpus.idx", "unsupported version 2", "expected 1"});
}

TEST(IndexedDataset, RejectsUnknownDtypeCode) {
  RawIndex raw = valid_index();
  raw.dtype_code = 9;
  expect_corrupt(raw, {"corpus.idx", "unknown dtype code 9"});
  raw.dtype_code = 0;
  expect_corrupt(raw, {"corpus.idx", "unknown dtype code 0"});
}

TEST(IndexedDataset, RejectsCountsThatMakeTheIndexLargerThanTheFile) {
  RawIndex raw = valid_index();
  raw.sequence_count = 5;
  expect_corrupt(raw, {"corpus.idx", "5 sequences", "need 126 bytes", "has 102 bytes"});
  raw.sequence_count = uint64_t{1} << 62;
  expect_corrupt(raw, {"corpus.idx", "4611686018427387904 sequences", "more than 2^61"});
}

TEST(IndexedDataset, RejectsCountsThatMakeTheIndexSmallerThanTheFile) {
  RawIndex raw = valid_index();
  raw.trailing_bytes = 8;
  expect_corrupt(raw, {"corpus.idx", "need 102 bytes", "has 110 bytes"});
  raw = valid_index();
  raw.document_count = 3;
  expect_corrupt(raw, {"corpus.idx", "3 document indices", "need 94 bytes", "has 102 bytes"});
}

TEST(IndexedDataset, RejectsNegativeSizes) {
  RawIndex raw = valid_index();
  raw.sizes = {3, -2, 2};
  expect_corrupt(raw, {"corpus.idx", "sizes[1] is -2"});
}

TEST(IndexedDataset, RejectsPointersThatDoNotFollowTheSizes) {
  RawIndex raw = valid_index();
  raw.pointers = {0, 6, 8};
  expect_corrupt(raw, {"corpus.idx", "pointers[2] is 8", "byte offset 6", "uint16"});
  raw.pointers = {2, 8, 8};
  expect_corrupt(raw, {"corpus.idx", "pointers[0] is 2", "byte offset 0"});
}

TEST(IndexedDataset, RejectsASequencePastTheEndOfBin) {
  expect_corrupt(valid_index(), {"corpus.bin", "sequence 2 ends at byte 10", "has 9 bytes"}, 9);
}

TEST(IndexedDataset, RejectsDocumentIndicesNotStartingAtZero) {
  RawIndex raw = valid_index();
  raw.document_indices = {1, 1, 2, 3};
  expect_corrupt(raw, {"corpus.idx", "document_indices[0] is 1", "expected 0"});
}

TEST(IndexedDataset, RejectsDocumentIndicesNotEndingAtTheSequenceCount) {
  RawIndex raw = valid_index();
  raw.document_indices = {0, 1, 2, 2};
  expect_corrupt(raw, {"corpus.idx", "last document_indices entry [3] is 2", "sequence count 3"});
}

TEST(IndexedDataset, RejectsDecreasingDocumentIndices) {
  RawIndex raw = valid_index();
  raw.document_indices = {0, 2, 1, 3};
  expect_corrupt(raw, {"corpus.idx", "decrease", "[2] = 1", "[1] = 2"});
}

TEST(IndexedDataset, RejectsEmptyDocumentIndices) {
  RawIndex raw = valid_index();
  raw.document_indices = {};
  expect_corrupt(raw, {"corpus.idx", "document_indices is empty"});
}

// ---- builder ----

TEST(IndexedDatasetBuilder, RejectsIdsTheDtypeCannotHold) {
  const std::string prefix = testing::make_temp_dir("idx_builder") + "/corpus";
  IndexedDatasetBuilder builder(prefix, IndexDType::UInt16);
  builder.add_sequence(std::vector<int32_t>{1, 2});
  expect_error(
      [&] {
        builder.add_sequence(std::vector<int32_t>{3, 65536});
      },
      {"token id 65536", "sequence 1, token 1", "uint16", "[0, 65535]"});
  expect_error([&] { builder.add_sequence(std::vector<int32_t>{-1}); }, {"token id -1", "uint16"});
  expect_error([&] { builder.add_sequence(std::vector<int64_t>{int64_t{1} << 33}); }, {"8589934592", "uint16"});
  builder.finish();
  // The rejected sequences were not appended.
  const IndexedDataset ds = IndexedDataset::open(prefix);
  ASSERT_EQ(ds.num_sequences(), 1);
  EXPECT_EQ(ds.read(0), (std::vector<int32_t>{1, 2}));
}

TEST(IndexedDatasetBuilder, RejectsFloatDtypes) {
  const std::string prefix = testing::make_temp_dir("idx_builder") + "/corpus";
  expect_error([&] { IndexedDatasetBuilder(prefix, IndexDType::Float32); }, {"float32", "integer dtype"});
}

TEST(IndexedDatasetBuilder, AcceptsTheIdxDtypeCode) {
  const std::string prefix = testing::make_temp_dir("idx_builder") + "/corpus";
  IndexedDatasetBuilder builder(prefix, 4);
  builder.add_sequence(std::vector<int32_t>{100000});
  builder.finish();
  EXPECT_EQ(IndexedDataset::open(prefix).dtype(), IndexDType::Int32);
  expect_error([&] { IndexedDatasetBuilder(prefix, 9); }, {"unknown dtype code 9", "1..8"});
  expect_error([&] { IndexedDatasetBuilder(prefix, 264); }, {"unknown dtype code 264"});
}

TEST(IndexedDatasetBuilder, LeavesNoFilesWithoutFinish) {
  const std::string dir = testing::make_temp_dir("idx_builder");
  {
    IndexedDatasetBuilder builder(dir + "/corpus", IndexDType::Int32);
    builder.add_sequence(std::vector<int32_t>{1, 2, 3});
    EXPECT_FALSE(fs::is_empty(dir)) << "the tokens stream into a temporary file";
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

// Issue 20: a "<out>.bin.tmp" symlink planted beside the output is never followed: its target keeps its bytes, and
// the dataset is written (the temporary files are new names created exclusively).
TEST(IndexedDatasetBuilder, NeverWritesThroughAPlantedTemporarySymlink) {
  const std::string dir = testing::make_temp_dir("idx_builder_symlink");
  const std::string victim = dir + "/victim";
  { std::ofstream(victim) << "precious"; }
  for (const char* name : {"/corpus.bin.tmp", "/corpus.idx.tmp"}) fs::create_symlink(victim, dir + name);
  for (const char* name : {"/corpus.bin.tmp-", "/corpus.idx.tmp-"}) {
    fs::create_symlink(victim, dir + name + std::to_string(::getpid()) + "-0");
  }
  IndexedDatasetBuilder builder(dir + "/corpus", IndexDType::Int32);
  builder.add_sequence(std::vector<int32_t>{1, 2, 3});
  builder.finish();
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious");
  EXPECT_EQ(IndexedDataset::open(dir + "/corpus").num_sequences(), 1);
}

TEST(IndexedDatasetBuilder, ReplacesAnExistingDatasetOnlyAtFinish) {
  const std::string prefix = testing::make_temp_dir("idx_builder") + "/corpus";
  {
    IndexedDatasetBuilder first(prefix, IndexDType::UInt16);
    first.add_sequence(std::vector<int32_t>{4, 5});
    first.finish();
  }
  IndexedDatasetBuilder second(prefix, IndexDType::Int32);
  second.add_sequence(std::vector<int32_t>{6, 7, 8});
  EXPECT_EQ(IndexedDataset::open(prefix).read(0), (std::vector<int32_t>{4, 5}));
  second.finish();
  const IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.dtype(), IndexDType::Int32);
  EXPECT_EQ(ds.read(0), (std::vector<int32_t>{6, 7, 8}));
}

TEST(IndexedDataset, DtypeNamesAndCodesFollowMegatron) {
  EXPECT_EQ(index_dtype_from_code(8), IndexDType::UInt16);
  EXPECT_EQ(index_dtype_from_code(4), IndexDType::Int32);
  EXPECT_EQ(index_dtype_from_code(9), std::nullopt);
  EXPECT_EQ(index_dtype_from_name("uint16"), IndexDType::UInt16);
  EXPECT_EQ(index_dtype_from_name("float16"), std::nullopt);
  EXPECT_EQ(index_dtype_size(IndexDType::Int64), 8u);
  EXPECT_EQ(index_dtype_for_max_id(65535), IndexDType::UInt16);
  EXPECT_EQ(index_dtype_for_max_id(65536), IndexDType::Int32);
}

}  // namespace
}  // namespace moetrain::train::data
