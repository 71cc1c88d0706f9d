// Tests for train/data/prepare, train/data/text_tokenizer and `moetrain data prepare`
// (cli/data_command): the three input kinds, EOD handling, and bad inputs that must leave no files.
#include "train/data/prepare.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string_view>

#include <gtest/gtest.h>
#include <CLI/CLI.hpp>

#include "cli/data_command.h"
#include "core/error.h"
#include "testing/error_message.h"
#include "testing/test_data.h"
#include "train/data/indexed_dataset.h"
#include "train/data/text_tokenizer.h"

namespace moetrain::train::data {
namespace {

using testing::expect_error;

namespace fs = std::filesystem;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

std::vector<std::vector<int32_t>> read_all(const std::string& prefix) {
  const IndexedDataset ds = IndexedDataset::open(prefix);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t i = 0; i < ds.num_sequences(); ++i) docs.push_back(ds.read(i));
  return docs;
}

std::vector<int32_t> bytes_then_eod(std::string_view text) {
  std::vector<int32_t> ids = byte_encode(text);
  ids.push_back(kByteEod);
  return ids;
}

// ---- byte tokenizer ----

TEST(ByteTokenizer, EncodesUtf8Bytes) {
  EXPECT_EQ(byte_encode("a\xc3\xa9 "), (std::vector<int32_t>{97, 195, 169, 32}));
  EXPECT_TRUE(byte_encode("").empty());
  EXPECT_EQ(kByteVocab, 257);
  EXPECT_EQ(kByteEod, 256);
}

TEST(ByteTokenizer, DecodesBytesAndEod) {
  const std::vector<int32_t> ids{104, 105, 256, 195, 169};
  EXPECT_EQ(byte_decode(ids), "hi\n<eod>\n\xc3\xa9");
  EXPECT_EQ(byte_decode(byte_encode("round trip \xe2\x9c\x93")), "round trip \xe2\x9c\x93");
}

TEST(ByteTokenizer, RejectsIdsOutsideTheByteVocabulary) {
  const std::vector<int32_t> ids{1, 257};
  expect_error([&] { byte_decode(ids); }, {"id 257", "position 1", "[0, 257)"});
}

// ---- prepare ----

TEST(DataPrepare, JsonlTokenIdsGetTheEodAppended) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/in.jsonl", "{\"tokens\": [5, 6, 7], \"meta\": \"x\"}\n\n{\"tokens\": [8]}\n{\"tokens\": []}\n");
  PrepareOptions options;
  options.input = dir + "/in.jsonl";
  options.output = dir + "/out/corpus";
  options.eod = 2;
  const PrepareSummary summary = prepare_dataset(options);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(summary.tokens, 6);
  EXPECT_EQ(summary.skipped_empty, 1);
  EXPECT_EQ(summary.max_id, 8);
  EXPECT_EQ(summary.dtype, IndexDType::UInt16);
  EXPECT_EQ(summary.idx_path, dir + "/out/corpus.idx");
  EXPECT_EQ(summary.bin_path, dir + "/out/corpus.bin");
  EXPECT_EQ(read_all(options.output), (std::vector<std::vector<int32_t>>{{5, 6, 7, 2}, {8, 2}}));
}

TEST(DataPrepare, JsonlTokenIdsFromAnotherFieldPickInt32ForLargeIds) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/in.jsonl", "{\"ids\": [70000, 1]}\n");
  PrepareOptions options;
  options.input = dir + "/in.jsonl";
  options.field = "ids";
  options.output = dir + "/corpus";
  options.eod = 0;
  EXPECT_EQ(prepare_dataset(options).dtype, IndexDType::Int32);
  const IndexedDataset ds = IndexedDataset::open(options.output);
  EXPECT_EQ(ds.dtype(), IndexDType::Int32);
  EXPECT_EQ(ds.read(0), (std::vector<int32_t>{70000, 1, 0}));
}

TEST(DataPrepare, ExplicitDtypeIsStored) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/in.jsonl", "{\"tokens\": [3]}\n");
  PrepareOptions options;
  options.input = dir + "/in.jsonl";
  options.output = dir + "/corpus";
  options.eod = 1;
  options.dtype = "int32";
  prepare_dataset(options);
  EXPECT_EQ(IndexedDataset::open(options.output).dtype(), IndexDType::Int32);
}

TEST(DataPrepare, JsonlTextIsByteTokenisedWithEod) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/in.jsonl", "{\"text\": \"ab\"}\n{\"text\": \"caf\\u00e9\\nline\"}\n");
  PrepareOptions options;
  options.input = dir + "/in.jsonl";
  options.text_field = "text";
  options.output = dir + "/corpus";
  const PrepareSummary summary = prepare_dataset(options);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(summary.tokens, 3 + 11);
  EXPECT_EQ(summary.dtype, IndexDType::UInt16);
  EXPECT_EQ(read_all(options.output),
            (std::vector<std::vector<int32_t>>{bytes_then_eod("ab"), bytes_then_eod("caf\xc3\xa9\nline")}));
}

TEST(DataPrepare, PlainTextParagraphsAreDocuments) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/a.txt", "\nfirst line\n  indented second\n\n \t\n\nsecond paragraph\n");
  write_text(dir + "/b.txt", "crlf one\r\ncrlf two\r\n\r\nlast without newline");
  PrepareOptions options;
  options.text_files = {dir + "/a.txt", dir + "/b.txt"};
  options.output = dir + "/corpus";
  const PrepareSummary summary = prepare_dataset(options);
  EXPECT_EQ(summary.documents, 4);
  EXPECT_EQ(read_all(options.output), (std::vector<std::vector<int32_t>>{
                                          bytes_then_eod("first line\n  indented second"),
                                          bytes_then_eod("second paragraph"),
                                          bytes_then_eod("crlf one\ncrlf two"),
                                          bytes_then_eod("last without newline"),
                                      }));
}

// Runs prepare on `jsonl` and expects an error naming every word, and no output files at all.
void expect_bad_input(const std::string& jsonl, std::initializer_list<std::string_view> words,
                      const std::function<void(PrepareOptions&)>& adjust = {}) {
  const std::string dir = testing::make_temp_dir("prepare_bad");
  write_text(dir + "/in.jsonl", jsonl);
  PrepareOptions options;
  options.input = dir + "/in.jsonl";
  options.output = dir + "/out/corpus";
  options.eod = 0;
  if (adjust) adjust(options);
  expect_error([&] { prepare_dataset(options); }, words);
  EXPECT_FALSE(fs::exists(dir + "/out")) << "bad input left output behind";
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << "only in.jsonl may remain";
}

TEST(DataPrepare, RejectsALineThatIsNotJson) {
  expect_bad_input("{\"tokens\": [1]}\n{\"tokens\": [1,\n", {"in.jsonl:2", "not JSON"});
  expect_bad_input("[1, 2]\n", {"in.jsonl:1", "JSON array", "expected a JSON object"});
}

TEST(DataPrepare, RejectsAMissingField) {
  expect_bad_input("{\"tokens\": [1]}\n{\"ids\": [1]}\n", {"in.jsonl:2", "missing field \"tokens\"", "--field"});
  expect_bad_input("{\"body\": \"x\"}\n", {"in.jsonl:1", "missing field \"text\"", "--text-field"},
                   [](PrepareOptions& o) {
                     o.text_field = "text";
                     o.eod.reset();
                   });
}

TEST(DataPrepare, RejectsFieldsOfTheWrongType) {
  expect_bad_input("{\"tokens\": \"1 2\"}\n", {"in.jsonl:1", "field \"tokens\" is string", "array"});
  expect_bad_input("{\"tokens\": [1, 2.5]}\n", {"in.jsonl:1", "field \"tokens\"[1] is number 2.5", "integer"});
  expect_bad_input("{\"text\": [1]}\n", {"in.jsonl:1", "field \"text\" is array", "text string"},
                   [](PrepareOptions& o) {
                     o.text_field = "text";
                     o.eod.reset();
                   });
}

TEST(DataPrepare, RejectsNegativeIds) {
  expect_bad_input("{\"tokens\": [1]}\n{\"tokens\": [4, -3]}\n",
                   {"in.jsonl:2", "field \"tokens\"[1]", "negative id -3"});
}

TEST(DataPrepare, RejectsIdsTheRequestedDtypeCannotHold) {
  expect_bad_input("{\"tokens\": [65536]}\n", {"in.jsonl:1", "token id 65536", "--dtype uint16", "--dtype int32"},
                   [](PrepareOptions& o) { o.dtype = "uint16"; });
  expect_bad_input("{\"tokens\": [2147483648]}\n", {"in.jsonl:1", "2147483648", "below 2^31"});
}

TEST(DataPrepare, RejectsEmptyInput) {
  expect_bad_input("", {"empty input", "in.jsonl"});
  expect_bad_input("{\"tokens\": []}\n", {"empty input", "1 empty ones skipped"});
}

TEST(DataPrepare, RejectsInconsistentOptions) {
  expect_bad_input("{\"tokens\": [1]}\n", {"--eod", "in.jsonl"}, [](PrepareOptions& o) { o.eod.reset(); });
  expect_bad_input("{\"text\": \"a\"}\n", {"--eod 0", "256"}, [](PrepareOptions& o) { o.text_field = "text"; });
  expect_bad_input("{\"tokens\": [1]}\n", {"--dtype", "int64", "uint16 or int32"},
                   [](PrepareOptions& o) { o.dtype = "int64"; });
  expect_bad_input("{\"tokens\": [1]}\n", {"--input and --text exclude each other"},
                   [](PrepareOptions& o) { o.text_files = {o.input}; });
  expect_bad_input("{\"tokens\": [1]}\n", {"no input"}, [](PrepareOptions& o) { o.input.clear(); });
  expect_bad_input("{\"tokens\": [1]}\n", {"cannot open", "absent.jsonl"},
                   [](PrepareOptions& o) { o.input = fs::path(o.input).parent_path().string() + "/absent.jsonl"; });
}

TEST(DataPrepare, BadInputKeepsAnExistingDataset) {
  const std::string dir = testing::make_temp_dir("prepare");
  write_text(dir + "/good.jsonl", "{\"tokens\": [9, 9]}\n");
  write_text(dir + "/bad.jsonl", "{\"tokens\": [1]}\n{\"tokens\": [-1]}\n");
  PrepareOptions options;
  options.input = dir + "/good.jsonl";
  options.output = dir + "/corpus";
  options.eod = 0;
  prepare_dataset(options);
  options.input = dir + "/bad.jsonl";
  expect_error([&] { prepare_dataset(options); }, {"bad.jsonl:2"});
  EXPECT_EQ(read_all(options.output), (std::vector<std::vector<int32_t>>{{9, 9, 0}}));
  EXPECT_FALSE(fs::exists(dir + "/corpus.bin.tmp"));
}

// ---- the command line ----

TEST(DataCommand, PreparesFromTheCommandLine) {
  const std::string dir = testing::make_temp_dir("data_command");
  write_text(dir + "/in.jsonl", "{\"ids\": [3, 4]}\n");
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  app.parse("data prepare --input " + dir + "/in.jsonl --field ids --eod 1 --dtype int32 --output " + dir + "/c",
            false);
  ASSERT_TRUE(command);
  EXPECT_EQ(command(), 0);
  const IndexedDataset ds = IndexedDataset::open(dir + "/c");
  EXPECT_EQ(ds.dtype(), IndexDType::Int32);
  EXPECT_EQ(ds.read(0), (std::vector<int32_t>{3, 4, 1}));
}

TEST(DataCommand, PreparesPlainTextFiles) {
  const std::string dir = testing::make_temp_dir("data_command");
  write_text(dir + "/a.txt", "one\n\ntwo\n");
  write_text(dir + "/b.txt", "three\n");
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  app.parse("data prepare --text " + dir + "/a.txt " + dir + "/b.txt --output " + dir + "/c", false);
  ASSERT_TRUE(command);
  EXPECT_EQ(command(), 0);
  EXPECT_EQ(read_all(dir + "/c"),
            (std::vector<std::vector<int32_t>>{bytes_then_eod("one"), bytes_then_eod("two"), bytes_then_eod("three")}));
}

TEST(DataCommand, RejectsInputTogetherWithText) {
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  EXPECT_THROW(app.parse("data prepare --input a.jsonl --text b.txt --output c", false), CLI::ParseError);
  EXPECT_FALSE(command);
}

TEST(DataCommand, RequiresAnOutput) {
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  EXPECT_THROW(app.parse("data prepare --text b.txt", false), CLI::ParseError);
}

}  // namespace
}  // namespace moetrain::train::data
