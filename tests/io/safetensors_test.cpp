// Tests for io/safetensors and io/mapped_file: round trips of every dtype, metadata and sharded
// sets, zero-copy reads, the Hugging Face golden file, and one test per kind of malformed input.
#include "io/safetensors.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "io/mapped_file.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::io {
namespace {

using testing::expect_error;

namespace fs = std::filesystem;
using Named = std::vector<std::pair<std::string, Tensor>>;

constexpr DType kAllDTypes[] = {DType::F64,    DType::F32, DType::BF16, DType::F16, DType::F8E4M3,
                                DType::F8E5M2, DType::I64, DType::I32,  DType::I16, DType::I8,
                                DType::U64,    DType::U32, DType::U16,  DType::U8,  DType::Bool};

// A tensor whose bytes follow a pattern that depends on `seed` (any bit pattern is a valid value of
// the float types for a byte-exact round trip; bools hold 0 or 1).
Tensor patterned(const Shape& shape, DType dtype, int seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) {
    bytes[i] = dtype == DType::Bool ? uint8_t((i + seed) % 2) : uint8_t(i * 31 + seed * 7 + 3);
  }
  return t;
}

void expect_same_tensor(const Tensor& actual, const Tensor& expected, const std::string& name) {
  EXPECT_EQ(actual.dtype(), expected.dtype()) << name;
  EXPECT_EQ(actual.shape(), expected.shape()) << name;
  ASSERT_EQ(actual.nbytes(), expected.nbytes()) << name;
  if (expected.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(actual.raw_data(), expected.raw_data(), expected.nbytes()), 0) << name << ": bytes differ";
  }
}

// Writes a safetensors file by hand: the u64 length (the header's own by default), header, data.
void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data,
               std::optional<uint64_t> declared_length = std::nullopt) {
  const uint64_t length = declared_length.value_or(header.size());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(uint8_t(length >> (8 * i))));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void expect_open_error(const std::string& path, std::initializer_list<std::string_view> words) {
  expect_error([&] { SafetensorsFile::open(path); }, words);
}

// ---- MappedFile ----

TEST(MappedFile, MapsWholeFile) {
  const std::string path = testing::make_temp_dir("mapped") + "/bytes.bin";
  write_text(path, "hello mapping");
  auto file = MappedFile::open(path);
  EXPECT_EQ(file->path(), path);
  ASSERT_EQ(file->size(), 13u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file->data()), file->size()), "hello mapping");
}

TEST(MappedFile, MapsZeroLengthFile) {
  const std::string path = testing::make_temp_dir("mapped") + "/empty.bin";
  write_text(path, "");
  auto file = MappedFile::open(path);
  EXPECT_EQ(file->size(), 0u);
  EXPECT_EQ(file->data(), nullptr);
}

TEST(MappedFile, MissingFileNamesPathAndReason) {
  const std::string path = testing::make_temp_dir("mapped") + "/absent.bin";
  expect_error([&] { MappedFile::open(path); }, {path, "No such file"});
}

TEST(MappedFile, FolderIsNotARegularFile) {
  const std::string dir = testing::make_temp_dir("mapped");
  expect_error([&] { MappedFile::open(dir); }, {dir, "not a regular file"});
}

// ---- round trips ----

TEST(Safetensors, RoundTripsEveryDtypeIncludingScalarsAndEmptyTensors) {
  const std::string path = testing::make_temp_dir("st") + "/all.safetensors";
  Named tensors;
  int seed = 0;
  for (DType dtype : kAllDTypes) {
    const std::string name(dtype_name(dtype));
    tensors.emplace_back(name + ".matrix", patterned({3, 5}, dtype, ++seed));
    tensors.emplace_back(name + ".scalar", patterned({}, dtype, ++seed));
    tensors.emplace_back(name + ".empty", patterned({4, 0, 2}, dtype, ++seed));
  }
  write_safetensors(path, tensors);

  const SafetensorsFile file = SafetensorsFile::open(path);
  const std::vector<std::string> names = file.names();
  EXPECT_EQ(names.size(), tensors.size());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_TRUE(file.metadata().empty());
  for (const auto& [name, expected] : tensors) {
    ASSERT_TRUE(file.contains(name)) << name;
    EXPECT_EQ(file.entry(name).dtype, expected.dtype()) << name;
    EXPECT_EQ(file.entry(name).shape, expected.shape()) << name;
    expect_same_tensor(file.tensor(name), expected, name);
  }
  EXPECT_EQ(file.tensor("f32.scalar").dim(), 0);
  EXPECT_EQ(file.tensor("f32.scalar").numel(), 1);
  EXPECT_EQ(file.tensor("bf16.empty").numel(), 0);
}

TEST(Safetensors, WritesPaddedHeaderAndTensorsBackToBackInGivenOrder) {
  const std::string path = testing::make_temp_dir("st") + "/layout.safetensors";
  const Named tensors = {{"z.first", patterned({3}, DType::U8, 1)},
                         {"a.second", patterned({2, 2}, DType::F32, 2)},
                         {"m.third", patterned({5}, DType::BF16, 3)}};
  write_safetensors(path, tensors);

  const std::string bytes = read_text(path);
  uint64_t header_length = 0;
  for (int i = 0; i < 8; ++i) header_length |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_length + 3 + 16 + 10);
  const std::string header = bytes.substr(8, header_length);
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}')) << "padding must be spaces: " << header;

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.entry("z.first").begin, 0u);
  EXPECT_EQ(file.entry("z.first").end, 3u);
  EXPECT_EQ(file.entry("a.second").begin, 3u);
  EXPECT_EQ(file.entry("a.second").end, 19u);
  EXPECT_EQ(file.entry("m.third").begin, 19u);
  EXPECT_EQ(file.entry("m.third").end, 29u);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a.second", "m.third", "z.first"}));
}

TEST(Safetensors, RoundTripsMetadata) {
  const std::string path = testing::make_temp_dir("st") + "/meta.safetensors";
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "1200"}, {"note", "a \"quoted\" é"}};
  write_safetensors(path, {{"w", patterned({2}, DType::F32, 1)}}, metadata);
  EXPECT_EQ(SafetensorsFile::open(path).metadata(), metadata);
}

TEST(Safetensors, WritesAndReadsAFileWithoutTensors) {
  const std::string path = testing::make_temp_dir("st") + "/none.safetensors";
  write_safetensors(path, {}, {{"k", "v"}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_TRUE(file.names().empty());
  EXPECT_EQ(file.metadata().at("k"), "v");
}

TEST(Safetensors, ShardedRoundTripThroughFolderAndIndex) {
  const std::string dir = testing::make_temp_dir("st_sharded");
  // 400-byte tensors with a 2000-byte one in the middle and a 1000-byte limit: shards [a, b], [c],
  // [big] (alone, over the limit), [d, e].
  const Named tensors = {{"a", patterned({100}, DType::F32, 1)},  {"b", patterned({50}, DType::F64, 2)},
                         {"c", patterned({200}, DType::BF16, 3)}, {"big", patterned({500}, DType::I32, 4)},
                         {"d", patterned({400}, DType::U8, 5)},   {"e", patterned({10, 10}, DType::F32, 6)}};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const auto written = write_safetensors_sharded(dir, "model", tensors, 1000, metadata);
  const std::vector<std::string> expected_files = {
      dir + "/model-00001-of-00004.safetensors", dir + "/model-00002-of-00004.safetensors",
      dir + "/model-00003-of-00004.safetensors", dir + "/model-00004-of-00004.safetensors",
      dir + "/model.safetensors.index.json"};
  EXPECT_EQ(written, expected_files);
  for (const std::string& file : expected_files) EXPECT_TRUE(fs::exists(file)) << file;
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));

  const auto index = nlohmann::json::parse(read_text(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 400u + 400 + 400 + 2000 + 400 + 400);
  EXPECT_EQ(index["weight_map"]["a"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["b"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["c"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["big"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["d"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["e"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(SafetensorsFile::open(expected_files[0]).metadata(), metadata);

  for (const std::string& path : {dir, dir + "/model.safetensors.index.json"}) {
    const SafetensorsReader reader = SafetensorsReader::open(path);
    EXPECT_EQ(reader.names(), (std::vector<std::string>{"a", "b", "big", "c", "d", "e"})) << path;
    for (const auto& [name, expected] : tensors) {
      ASSERT_TRUE(reader.contains(name)) << name;
      EXPECT_EQ(reader.entry(name).shape, expected.shape());
      expect_same_tensor(reader.tensor(name), expected, name);
    }
    EXPECT_EQ(reader.file_of("big"), expected_files[2]);
    EXPECT_EQ(reader.file_of("e"), expected_files[3]);
    EXPECT_FALSE(reader.contains("f"));
    expect_error([&] { reader.tensor("f"); }, {"no tensor 'f'", path});
  }
}

TEST(Safetensors, ShardedWriteOfOneShardWritesASingleFile) {
  const std::string dir = testing::make_temp_dir("st_sharded");
  const Named tensors = {{"a", patterned({4}, DType::F32, 1)}, {"b", patterned({4}, DType::F32, 2)}};
  const auto written = write_safetensors_sharded(dir, "model", tensors, 1 << 20);
  EXPECT_EQ(written, (std::vector<std::string>{dir + "/model.safetensors"}));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  const SafetensorsReader reader = SafetensorsReader::open(dir);
  EXPECT_EQ(reader.file_of("a"), dir + "/model.safetensors");
  expect_same_tensor(reader.tensor("b"), tensors[1].second, "b");
}

TEST(Safetensors, ReaderOpensASingleFilePath) {
  const std::string path = testing::make_temp_dir("st") + "/weights.safetensors";
  write_safetensors(path, {{"x", patterned({3}, DType::I64, 1)}});
  const SafetensorsReader reader = SafetensorsReader::open(path);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"x"}));
  EXPECT_EQ(reader.file_of("x"), path);
  EXPECT_EQ(reader.entry("x").dtype, DType::I64);
}

TEST(Safetensors, AlignedTensorsAreZeroCopyViewsIntoTheMapping) {
  const std::string path = testing::make_temp_dir("st") + "/view.safetensors";
  write_safetensors(path, {{"w", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})}});
  Tensor t;
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
  {
    const SafetensorsFile file = SafetensorsFile::open(path);
    t = file.tensor("w");
    begin = file.mapping()->data();
    end = begin + file.mapping()->size();
    const auto* p = static_cast<const uint8_t*>(t.raw_data());
    EXPECT_TRUE(p >= begin && p + t.nbytes() <= end) << "tensor data is not inside the mapping";
    EXPECT_EQ(file.tensor("w").raw_data(), t.raw_data()) << "two reads must share the mapping";
  }
  // The tensor keeps the mapping alive after the file object is gone.
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
}

TEST(Safetensors, MisalignedTensorIsCopiedToAlignedMemory) {
  const std::string path = testing::make_temp_dir("st") + "/misaligned.safetensors";
  // One byte of u8 first puts the f32 tensor at an odd address.
  const Tensor values = Tensor::from_vector<float>({1.5f, -2.0f, 3.25f}, {3});
  write_safetensors(path, {{"pad", patterned({1}, DType::U8, 1)}, {"f", values}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  const Tensor t = file.tensor("f");
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  const uint8_t* begin = file.mapping()->data();
  EXPECT_FALSE(p >= begin && p < begin + file.mapping()->size()) << "a misaligned tensor must be copied";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % sizeof(float), 0u);
  EXPECT_EQ(t.to_vector<float>(), values.to_vector<float>());
}

TEST(Safetensors, ReadsHuggingFaceQwen3File) {
  const std::string path = testing::test_data_path("golden/qwen3/model.safetensors");
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names().size(), 25u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const SafetensorsEntry& lm_head = file.entry("lm_head.weight");
  EXPECT_EQ(lm_head.dtype, DType::F32);
  EXPECT_EQ(lm_head.shape, (Shape{512, 64}));
  const Tensor t = file.tensor("lm_head.weight");
  EXPECT_EQ(t.shape(), (Shape{512, 64}));
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  EXPECT_TRUE(p >= file.mapping()->data() && p + t.nbytes() <= file.mapping()->data() + file.mapping()->size());

  const SafetensorsReader reader = SafetensorsReader::open(testing::test_data_path("golden/qwen3"));
  EXPECT_EQ(reader.names(), file.names());
  EXPECT_EQ(reader.entry("lm_head.weight").shape, (Shape{512, 64}));
}

// ---- the atomic writer ----

TEST(Safetensors, AtomicWriteLeavesNoTemporaryFile) {
  const std::string dir = testing::make_temp_dir("st_atomic");
  write_safetensors(dir + "/w.safetensors", {{"x", patterned({8}, DType::F32, 1)}});
  std::vector<std::string> files;
  for (const auto& item : fs::directory_iterator(dir)) files.push_back(item.path().filename().string());
  EXPECT_EQ(files, (std::vector<std::string>{"w.safetensors"}));
}

TEST(Safetensors, WritingOverAnExistingFileReplacesIt) {
  const std::string path = testing::make_temp_dir("st_atomic") + "/w.safetensors";
  write_safetensors(path, {{"old", patterned({1000}, DType::F64, 1)}});
  const Tensor fresh = patterned({3}, DType::I16, 2);
  write_safetensors(path, {{"new", fresh}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"new"}));
  expect_same_tensor(file.tensor("new"), fresh, "new");
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(path).parent_path()), fs::directory_iterator()), 1)
      << "no temporary file left";
}

TEST(Safetensors, WriterRejectsDuplicateAndInvalidNames) {
  const std::string path = testing::make_temp_dir("st_atomic") + "/w.safetensors";
  const Tensor t = patterned({2}, DType::F32, 1);
  expect_error([&] { write_safetensors(path, {{"x", t}, {"x", t}}); }, {"'x'", "twice"});
  expect_error([&] { write_safetensors(path, {{"", t}}); }, {"empty name"});
  expect_error([&] { write_safetensors(path, {{"__metadata__", t}}); }, {"reserved"});
  expect_error([&] { write_safetensors(path, {{"u", Tensor()}}); }, {"'u'", "undefined"});
  EXPECT_FALSE(fs::exists(path)) << "a rejected write must not create the file";
  EXPECT_TRUE(fs::is_empty(fs::path(path).parent_path())) << "nor a temporary file";
}

// ---- malformed files ----

TEST(Safetensors, RejectsTruncatedFile) {
  const std::string dir = testing::make_temp_dir("st_bad");
  const std::string path = dir + "/cut.safetensors";
  write_safetensors(path, {{"a", patterned({4}, DType::F32, 1)}, {"b", patterned({4}, DType::F32, 2)}});
  const uint64_t size = fs::file_size(path);
  fs::resize_file(path, size - 4);
  expect_open_error(path, {path, "tensor 'b'", "ends at byte 32", "data section has 28"});
  fs::resize_file(path, 20);  // inside the header
  expect_open_error(path, {path, "declares a header of", "only 12 bytes"});
  fs::resize_file(path, 5);  // inside the length field
  expect_open_error(path, {path, "5 bytes", "8-byte header length"});
}

TEST(Safetensors, RejectsHeaderLengthLargerThanFile) {
  const std::string path = testing::make_temp_dir("st_bad") + "/long.safetensors";
  write_raw(path, "{}", {}, 4096);
  expect_open_error(path, {path, "declares a header of 4096 bytes", "only 2 bytes"});
  write_raw(path, "{}", {}, uint64_t(1) << 40);
  expect_open_error(path, {path, "more than the limit of 100000000 bytes"});
}

TEST(Safetensors, RejectsMalformedJson) {
  const std::string path = testing::make_temp_dir("st_bad") + "/json.safetensors";
  write_raw(path, R"({"a": {"dtype": "F32", )", {});
  expect_open_error(path, {path, "not valid JSON"});
  write_raw(path, R"([1, 2])", {});
  expect_open_error(path, {path, "JSON array", "expected an object"});
}

TEST(Safetensors, RejectsOverlappingOffsets) {
  const std::string path = testing::make_temp_dir("st_bad") + "/overlap.safetensors";
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            std::vector<uint8_t>(12));
  expect_open_error(path, {path, "'a' and 'b'", "overlap", "begins at byte 4", "ends at byte 8"});
}

TEST(Safetensors, RejectsOffsetsOutOfRange) {
  const std::string path = testing::make_temp_dir("st_bad") + "/range.safetensors";
  write_raw(path, R"({"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
            std::vector<uint8_t>(16));
  expect_open_error(path, {path, "tensor 'model.norm.weight'", "ends at byte 24 but the data section has 16"});
}

TEST(Safetensors, RejectsHoleBetweenTensors) {
  const std::string path = testing::make_temp_dir("st_bad") + "/hole.safetensors";
  write_raw(path,
            R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}})",
            std::vector<uint8_t>(10));
  expect_open_error(path, {path, "hole", "[4, 6)", "'a'", "'b'"});
}

TEST(Safetensors, RejectsBytesAfterTheLastTensor) {
  const std::string path = testing::make_temp_dir("st_bad") + "/trailing.safetensors";
  write_raw(path, R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", std::vector<uint8_t>(7));
  expect_open_error(path, {path, "hole", "[4, 7)", "after tensor 'a'"});
}

TEST(Safetensors, RejectsHoleAtTheStart) {
  const std::string path = testing::make_temp_dir("st_bad") + "/lead.safetensors";
  write_raw(path, R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})", std::vector<uint8_t>(6));
  expect_open_error(path, {path, "hole", "[0, 2)", "before tensor 'a'"});
}

TEST(Safetensors, RejectsShapeThatDoesNotMatchByteSpan) {
  const std::string path = testing::make_temp_dir("st_bad") + "/span.safetensors";
  write_raw(path, R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})", std::vector<uint8_t>(24));
  expect_open_error(path, {path, "tensor 'w'", "spans 24 bytes", "[2, 3] x BF16", "needs 12 bytes"});
}

TEST(Safetensors, RejectsUnknownDtype) {
  const std::string path = testing::make_temp_dir("st_bad") + "/dtype.safetensors";
  write_raw(path, R"({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})", std::vector<uint8_t>(16));
  expect_open_error(path, {path, "tensor 'w'", "unknown dtype 'F128'", "F8_E4M3"});
}

TEST(Safetensors, RejectsDuplicateNames) {
  const std::string path = testing::make_temp_dir("st_bad") + "/dup.safetensors";
  write_raw(path,
            R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})",
            std::vector<uint8_t>(4));
  expect_open_error(path, {path, "tensor 'w' twice"});
  write_raw(path, R"({"w": {"dtype": "U8", "dtype": "I8", "shape": [2], "data_offsets": [0, 2]}})",
            std::vector<uint8_t>(2));
  expect_open_error(path, {path, "'dtype' twice", "'w'"});
}

TEST(Safetensors, RejectsMissingOrMistypedEntryFields) {
  const std::string path = testing::make_temp_dir("st_bad") + "/fields.safetensors";
  const std::vector<uint8_t> data(8);
  const auto check = [&](const std::string& header, std::initializer_list<std::string_view> words) {
    write_raw(path, header, data);
    expect_open_error(path, words);
  };
  check(R"({"w": [1, 2]})", {"tensor 'w'", "JSON array", "expected an object"});
  check(R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", {"tensor 'w'", "no 'dtype'"});
  check(R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", {"tensor 'w'", "dtype is a JSON number"});
  check(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", {"tensor 'w'", "no 'shape'"});
  check(R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", {"tensor 'w'", "expected an array"});
  check(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
        {"tensor 'w'", "shape entry 0 is -2", "non-negative integer"});
  check(R"({"w": {"dtype": "F32", "shape": [1, 2.5], "data_offsets": [0, 8]}})",
        {"tensor 'w'", "shape entry 1 is 2.5"});
  check(R"({"w": {"dtype": "F32", "shape": [2]}})", {"tensor 'w'", "no 'data_offsets'"});
  check(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}})",
        {"tensor 'w'", "data_offsets is [0,4,8]", "two non-negative integers"});
  check(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}})", {"tensor 'w'", "data_offsets is"});
  check(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", {"tensor 'w'", "[8, 0] begin after"});
}

TEST(Safetensors, RejectsMetadataThatIsNotStrings) {
  const std::string path = testing::make_temp_dir("st_bad") + "/meta.safetensors";
  write_raw(path, R"({"__metadata__": {"step": 12}})", {});
  expect_open_error(path, {path, "__metadata__", "'step'", "JSON number", "expected a string"});
  write_raw(path, R"({"__metadata__": ["pt"]})", {});
  expect_open_error(path, {path, "__metadata__", "JSON array"});
}

TEST(Safetensors, AbsentTensorErrorNamesFileAndTensor) {
  const std::string path = testing::make_temp_dir("st") + "/w.safetensors";
  write_safetensors(path, {{"x", patterned({1}, DType::F32, 1)}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  expect_error([&] { file.entry("model.norm.weight"); }, {path, "no tensor 'model.norm.weight'"});
  expect_error([&] { file.tensor("y"); }, {path, "no tensor 'y'"});
}

// ---- bad indexes ----

// Two valid shards s1 (a, b) and s2 (c) in a fresh folder; returns the folder.
std::string make_shards() {
  const std::string dir = testing::make_temp_dir("st_index");
  write_safetensors(dir + "/s1.safetensors",
                    {{"a", patterned({2}, DType::F32, 1)}, {"b", patterned({2}, DType::F32, 2)}});
  write_safetensors(dir + "/s2.safetensors", {{"c", patterned({2}, DType::F32, 3)}});
  return dir;
}

void expect_index_error(const std::string& dir, const std::string& index_text,
                        std::initializer_list<std::string_view> words) {
  const std::string index = dir + "/model.safetensors.index.json";
  write_text(index, index_text);
  expect_error([&] { SafetensorsReader::open(index); }, words);
  expect_error([&] { SafetensorsReader::open(dir); }, words);
}

TEST(SafetensorsIndex, ValidIndexOfHandWrittenShardsOpens) {
  const std::string dir = make_shards();
  write_text(dir + "/model.safetensors.index.json",
             R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})");
  const SafetensorsReader reader = SafetensorsReader::open(dir);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(reader.file_of("c"), dir + "/s2.safetensors");
}

// The index parse alone (what the loader runs before opening a shard, and the fuzz target): shard paths joined to the
// index's folder, and reading nothing.
TEST(SafetensorsIndex, ParsesTheWeightMapIntoPathsInsideTheFolder) {
  const auto map = parse_safetensors_index(R"({"metadata": {"total_size": 8}, "weight_map": {"b": "s1.safetensors",
                                              "a": "sub/s2.safetensors"}})",
                                           "/no/such/folder/model.safetensors.index.json");
  EXPECT_EQ(map, (std::map<std::string, std::string>{{"a", "/no/such/folder/sub/s2.safetensors"},
                                                     {"b", "/no/such/folder/s1.safetensors"}}));
  expect_error([] { parse_safetensors_index(R"({"weight_map": {}})", "m/index.json"); },
               {"safetensors index m/index.json", "weight_map names no tensors"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"a": "/etc/passwd"}})", "m/index.json"); },
               {"tensor 'a'", "'/etc/passwd'", "inside the model folder"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"a": "x/../../s.safetensors"}})", "m/index.json"); },
               {"tensor 'a'", "no '..'"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"a": ""}})", "m/index.json"); },
               {"tensor 'a'", "expected a shard file name"});
}

TEST(SafetensorsIndex, RejectsMalformedIndex) {
  const std::string dir = make_shards();
  expect_index_error(dir, R"({"weight_map": {"a": )", {"model.safetensors.index.json", "not valid JSON"});
  expect_index_error(dir, R"(["a"])", {"model.safetensors.index.json", "JSON array", "expected an object"});
  expect_index_error(dir, R"({"weight_map": {"a": 3}})", {"tensor 'a'", "expected a shard file name"});
  expect_index_error(dir, R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})",
                     {"key 'a' twice", "weight_map"});
}

TEST(SafetensorsIndex, RejectsMissingWeightMap) {
  const std::string dir = make_shards();
  expect_index_error(dir, R"({"metadata": {"total_size": 24}})", {"model.safetensors.index.json", "no 'weight_map'"});
  expect_index_error(dir, R"({"weight_map": []})", {"no 'weight_map' object", "JSON array"});
}

TEST(SafetensorsIndex, RejectsMissingShardFile) {
  const std::string dir = make_shards();
  expect_index_error(dir, R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s3.safetensors"}})",
                     {"shard " + dir + "/s3.safetensors", "tensor 'c'", "does not exist"});
}

TEST(SafetensorsIndex, RejectsTensorAssignedToShardWithoutIt) {
  const std::string dir = make_shards();
  expect_index_error(dir, R"({"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})",
                     {"tensor 'a'", "s2.safetensors but that shard does not contain it", "it is in"});
  expect_index_error(dir,
                     R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors",
                                        "d": "s2.safetensors"}})",
                     {"tensor 'd'", "does not contain it", "no shard does"});
}

TEST(SafetensorsIndex, RejectsTensorInTwoShards) {
  const std::string dir = make_shards();
  write_safetensors(dir + "/s2.safetensors",
                    {{"c", patterned({2}, DType::F32, 3)}, {"a", patterned({2}, DType::F32, 4)}});
  expect_index_error(dir, R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})",
                     {"tensor 'a'", "appears in two shards", "s1.safetensors", "s2.safetensors"});
}

TEST(SafetensorsIndex, RejectsShardTensorTheIndexDoesNotList) {
  const std::string dir = make_shards();
  expect_index_error(dir, R"({"weight_map": {"a": "s1.safetensors", "c": "s2.safetensors"}})",
                     {"tensor 'b'", "does not list"});
}

TEST(SafetensorsIndex, FolderWithBothSingleFileAndIndexIsAnError) {
  const std::string dir = make_shards();
  write_text(dir + "/model.safetensors.index.json",
             R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})");
  write_safetensors(dir + "/model.safetensors", {{"a", patterned({2}, DType::F32, 1)}});
  expect_error([&] { SafetensorsReader::open(dir); }, {dir, "both", "stale"});
  const std::string empty = testing::make_temp_dir("st_index");
  expect_error([&] { SafetensorsReader::open(empty); }, {empty, "neither"});
}

// ---- hostile input (issue 20) ----

// The header of n one-element f32 tensors "t0000000", ... laid out back to back, built in memory.
std::string many_tensor_header(int64_t n) {
  std::string header = "{";
  header.reserve(static_cast<size_t>(n) * 64);
  for (int64_t i = 0; i < n; ++i) {
    header += fmt::format(R"({}"t{:07d}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}})", i ? "," : "", i, 4 * i,
                          4 * i + 4);
  }
  return header + "}";
}

// CPU seconds of this thread: the machine running the suite may be shared, and a parse that waits for a core is not
// slower; the bound is on the work the parse does.
double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The least CPU time of three runs of `body`: the work it does, without what a busy machine adds to one run (on the
// shared 2-core box one parse ranges from 1.3 to 2.1 CPU seconds as the other tests load its memory).
template <typename Body>
double least_cpu_seconds(Body body) {
  double least = INFINITY;
  for (int run = 0; run < 3; ++run) {
    const double start = thread_cpu_seconds();
    body();
    least = std::min(least, thread_cpu_seconds() - start);
  }
  return least;
}

TEST(SafetensorsHeader, AMillionTensorsParseInLinearTime) {
  constexpr int64_t kTensors = 1'000'000;
  const std::string header = many_tensor_header(kTensors);
  SafetensorsHeader parsed;
  const double seconds =
      least_cpu_seconds([&] { parsed = parse_safetensors_header(header, 4 * kTensors, "million.safetensors"); });
  ASSERT_EQ(parsed.entries.size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(parsed.entries.at("t0999999").begin, 4 * (kTensors - 1));
  // Issue 20's bound; the quadratic parser took over 10 minutes here.
  EXPECT_LT(seconds, 2.0) << "a 1M-tensor header took " << seconds << " CPU seconds";

  // A repeated name among them is still found, whichever two collide.
  std::string repeated = header;
  const std::string last = R"("t0999999":)";
  repeated.replace(repeated.rfind(last), last.size(), R"("t0000007":)");
  const double refused = least_cpu_seconds([&] {
    expect_error([&] { parse_safetensors_header(repeated, 4 * kTensors, "million.safetensors"); },
                 {"million.safetensors", "names tensor 't0000007' twice"});
  });
  EXPECT_LT(refused, 2.0) << "refusing a 1M-tensor header took " << refused << " CPU seconds";
}

// What parse_safetensors_header makes of `header`: its entries and metadata, or its error's message.
std::string header_outcome(const std::string& header, uint64_t data_size) {
  try {
    const SafetensorsHeader parsed = parse_safetensors_header(header, data_size, "probe.safetensors");
    std::string outcome = "parsed:";
    for (const auto& [name, e] : parsed.entries) {
      outcome +=
          fmt::format(" {}={}{}[{},{})", name, dtype_safetensors_name(e.dtype), shape_str(e.shape), e.begin, e.end);
    }
    for (const auto& [key, value] : parsed.metadata) outcome += fmt::format(" meta {}={}", key, value);
    return outcome;
  } catch (const Error& e) {
    // A syntax error's position moves with the text before it; the rest of the message is the outcome.
    const std::string message = e.what();
    const std::string_view syntax = "is not valid JSON";
    const size_t at = message.find(syntax);
    return "refused: " + (at == std::string::npos ? message : message.substr(0, at + syntax.size()));
  }
}

// The well-formed headers are read without a JSON value per entry and anything else by the general parser: a key
// the format does not define, put first in the first entry, sends the whole text to the general parser, which must
// give the same entries, or the same error from the same entry, as the fast reading (where it did not stop first).
TEST(SafetensorsHeader, TheWellFormedReaderAndTheGeneralParserAgree) {
  struct Case {
    std::string header;  // '@' marks where the unknown key goes
    uint64_t data_size;
  };
  const Case cases[] = {
      {R"({"a": {@"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8},
      {R"({"__metadata__": {"format": "pt", "step": "12"}, "b": {@"shape": [], "data_offsets": [2, 4],
          "dtype": "BF16"}, "a": {"data_offsets": [0, 2], "dtype": "U8", "shape": [2, 1]}, "z": {"dtype": "F64",
          "shape": [0, 3], "data_offsets": [4, 4]}})",
       4},
      {R"({"a": {@"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {}})", 8},
      // Refused by the fast reading (an entry's values) and by the general parser the same way.
      {R"({"a": {@"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})", 16},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "F7", "shape": [1],
          "data_offsets": [2, 3]}, "c": {"dtype": "U8", "dtype": "I8", "shape": [1], "data_offsets": [3, 4]}})",
       4},
      {R"({"a": {@"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}})", 8},
      {R"({"a": {@"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", 8},
      {R"({"a": {@"dtype": "F64", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})", 8},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "a": {"dtype": "U8", "shape": [2],
          "data_offsets": [2, 4]}})",
       4},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2],
          "data_offsets": [4, 6]}})",
       6},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"x": "1"},
          "__metadata__": {"y": "2"}})",
       2},
      // Where the fast reading stops and hands over.
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2],
          "data_offsets": [2, 4], "dtype": "U8"}})",
       4},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": [1, 2]})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": 4}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2, -1], "data_offsets": [0, 2]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 2]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [[2]], "data_offsets": [0, 2]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 1, 2]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2.0]}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"x": 1}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"x": "1", "x": "2"}})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": ["x"]})", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}} trailing)", 2},
      {R"({"a": {@"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2], )", 2},
  };
  for (const Case& c : cases) {
    const size_t at = c.header.find('@');
    ASSERT_NE(at, std::string::npos) << c.header;
    const std::string well_formed = std::string(c.header).erase(at, 1);
    const std::string with_unknown_key = std::string(c.header).replace(at, 1, R"("note": {"k": [1, "x"]}, )");
    const std::string outcome = header_outcome(well_formed, c.data_size);
    EXPECT_EQ(outcome, header_outcome(with_unknown_key, c.data_size)) << well_formed;
  }
  // The first case parses; the fifth is refused for its dtype (a check that these are not all one outcome).
  EXPECT_EQ(header_outcome(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8),
            "parsed: a=F32[2][0,8)");
  EXPECT_EQ(header_outcome("{}", 0), "parsed:");
  EXPECT_NE(header_outcome(R"({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})", 16)
                .find("unknown dtype 'F128'"),
            std::string::npos);
}

TEST(SafetensorsHeader, BytesAfterANulAreRefused) {
  const std::string good = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_EQ(parse_safetensors_header(good, 4, "nul.safetensors").entries.size(), 1u);
  expect_error([&] { parse_safetensors_header(good + std::string(1, '\0') + "GARBAGE", 4, "nul.safetensors"); },
               {"nul.safetensors", "NUL byte at byte 54"});
  expect_error([&] { parse_safetensors_header(good + "GARBAGE", 4, "trailing.safetensors"); },
               {"trailing.safetensors", "not valid JSON"});
  // The same through a file: the NUL inside the declared header length.
  const std::string path = testing::make_temp_dir("st_nul") + "/w.safetensors";
  std::string header = good + std::string(1, '\0') + "GARBAGE";
  write_raw(path, header, {0, 0, 128, 63});
  expect_open_error(path, {path, "NUL byte"});
}

TEST(SafetensorsHeader, ANumberPastDoubleIsRefusedNamingTheFile) {
  expect_error([&] { parse_safetensors_header(R"({"__metadata__":{"x":1e400}})", 0, "big.safetensors"); },
               {"big.safetensors", "not valid JSON"});
}

TEST(SafetensorsIndex, ShardPathsMustStayInsideTheModelFolder) {
  const std::string dir = make_shards();
  const std::string outside = testing::make_temp_dir("st_outside");
  write_safetensors(outside + "/x.safetensors", {{"a", patterned({2}, DType::F32, 1)}});
  const std::string name = fs::path(outside).filename().string();
  expect_index_error(dir, R"({"weight_map": {"a": "../)" + name + R"(/x.safetensors"}})",
                     {"tensor 'a'", "inside the model folder", "'..'"});
  expect_index_error(dir, R"({"weight_map": {"a": ")" + outside + R"(/x.safetensors"}})",
                     {"tensor 'a'", "inside the model folder", "absolute"});
}

TEST(SafetensorsIndex, AFifoShardOrFileIsRefusedWithoutBlocking) {
  const std::string dir = testing::make_temp_dir("st_fifo");
  ASSERT_EQ(::mkfifo((dir + "/model.safetensors").c_str(), 0600), 0);
  expect_error([&] { SafetensorsReader::open(dir); }, {"model.safetensors", "not a regular file"});
  expect_error([&] { SafetensorsFile::open(dir + "/model.safetensors"); }, {"not a regular file"});
  const std::string indexed = make_shards();
  ASSERT_EQ(::mkfifo((indexed + "/model.safetensors.index.json").c_str(), 0600), 0);
  expect_error([&] { SafetensorsReader::open(indexed); }, {"model.safetensors.index.json", "regular file"});
}

// score --out and convert --out write through write_safetensors: a "<out>.tmp" symlink planted beside the output
// (the old fixed temporary name) or the next free name is never followed, so its target keeps its bytes.
TEST(Safetensors, WritingNeverFollowsAPlantedTemporarySymlink) {
  const std::string dir = testing::make_temp_dir("st_symlink");
  const std::string victim = dir + "/victim";
  write_text(victim, "precious");
  const std::string path = dir + "/out.safetensors";
  fs::create_symlink(victim, path + ".tmp");
  fs::create_symlink(victim, path + ".tmp-" + std::to_string(::getpid()) + "-0");
  const Tensor t = patterned({4}, DType::F32, 3);
  write_safetensors(path, {{"x", t}});
  EXPECT_EQ(read_text(victim), "precious");
  expect_same_tensor(SafetensorsFile::open(path).tensor("x"), t, "x");
}

}  // namespace
}  // namespace moetrain::io
