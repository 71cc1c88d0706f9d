// Tests for train/data/bpe_tokenizer, pretokenizer and unicode, and `data prepare --tokenizer`: ids identical to the
// Hugging Face tokenizers library's on the fixtures of tests/data/tokenizer (scripts/make_tokenizer_fixture.py), the
// split patterns against tokenizers' pre_tokenize_str, NFC against unicodedata, the EOD rule, and refusals that leave
// no output behind.
#include "train/data/bpe_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string_view>

#include <gtest/gtest.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/data_command.h"
#include "core/error.h"
#include "testing/error_message.h"
#include "testing/test_data.h"
#include "train/data/indexed_dataset.h"
#include "train/data/prepare.h"
#include "train/data/pretokenizer.h"
#include "train/data/unicode.h"

namespace moetrain::train::data {
namespace {

using testing::expect_error;

namespace fs = std::filesystem;
using nlohmann::json;

std::string fixture(const std::string& name) { return testing::test_data_path("tokenizer/" + name); }

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.is_open()) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

std::vector<json> read_jsonl(const std::string& path) {
  std::vector<json> rows;
  std::istringstream in(read_text(path));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(json::parse(line));
  }
  return rows;
}

std::vector<std::string> corpus() {
  std::vector<std::string> texts;
  for (const json& row : read_jsonl(fixture("corpus.jsonl"))) texts.push_back(row["text"].get<std::string>());
  return texts;
}

// Every fixture document's ids against tokenizers', through one encoder (its word cache warm for the second pass)
// and through encode() (no cache). Returns the number of documents compared.
size_t expect_fixture_ids(const std::string& name) {
  const BpeTokenizer tok = BpeTokenizer::load(fixture(name));
  const std::vector<std::string> texts = corpus();
  BpeEncoder encoder(tok);
  size_t compared = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (const json& row : read_jsonl(fixture(name + "/expected_ids.jsonl"))) {
      const size_t doc = row["doc"].get<size_t>();
      const std::vector<int32_t> expected = row["ids"].get<std::vector<int32_t>>();
      std::vector<int32_t> ids;
      encoder.encode(texts.at(doc), ids);
      EXPECT_EQ(ids, expected) << name << " document " << doc << " (pass " << pass << "): " << texts[doc];
      if (pass == 0) {
        EXPECT_EQ(tok.encode(texts[doc]), expected) << name << " document " << doc;
        ++compared;
      }
    }
  }
  return compared;
}

// ---- ids against tokenizers ----

TEST(BpeTokenizer, MatchesTokenizersOnTheQwenStyleFixture) {
  // NFC, Split(Qwen2 regex) + ByteLevel, three special tokens and added tokens with every flag.
  EXPECT_EQ(expect_fixture_ids("qwen"), corpus().size());
}

TEST(BpeTokenizer, MatchesTokenizersOnTheGpt2Fixture) {
  // ByteLevel(use_regex=true) alone, no normaliser.
  EXPECT_GE(expect_fixture_ids("gpt2"), 30u);
}

TEST(BpeTokenizer, MatchesTokenizersOnTheDeepSeekV3StyleFixture) {
  // Its three Splits (digits, CJK, the main pattern spelled with literal CR/LF), an empty normaliser Sequence and a
  // BOS template the encoding for training leaves out.
  EXPECT_GE(expect_fixture_ids("deepseek"), 30u);
  const BpeTokenizer tok = BpeTokenizer::load(fixture("deepseek"));
  EXPECT_NE(tok.describe().find("deepseek_v3_digits + deepseek_v3_cjk + deepseek_v3"), std::string::npos);
  EXPECT_NE(tok.post_processor_note().find("TemplateProcessing"), std::string::npos) << tok.post_processor_note();
}

TEST(BpeTokenizer, MatchesTokenizersOnTheO200kFixture) {
  // GPT-OSS's Split(o200k regex) + ByteLevel, no normaliser.
  EXPECT_GE(expect_fixture_ids("o200k"), 30u);
}

TEST(BpeTokenizer, ReadsTheFixtureConfiguration) {
  const BpeTokenizer tok = BpeTokenizer::load(fixture("qwen/tokenizer.json"));
  EXPECT_EQ(tok.vocab_size(), 2004);  // 2000 trained (3 special among them) + 4 added + [MASK]
  EXPECT_EQ(tok.token_id("<|endoftext|>"), 0);
  EXPECT_EQ(tok.token_id("<|im_end|>"), 2);
  EXPECT_FALSE(tok.token_id("not a token").has_value());
  EXPECT_NE(tok.describe().find("normalizer NFC; pre-tokenizer qwen2"), std::string::npos) << tok.describe();
  EXPECT_TRUE(tok.post_processor_note().empty());
  // Special tokens inside text map to their ids; [MASK] (lstrip, rstrip) takes the spaces around it.
  EXPECT_EQ(tok.encode("<|im_start|>"), (std::vector<int32_t>{1}));
  std::vector<int32_t> expected = tok.encode("a");
  expected.push_back(*tok.token_id("[MASK]"));
  for (int32_t id : tok.encode("b")) expected.push_back(id);
  EXPECT_EQ(tok.encode("a  [MASK] \tb"), expected);
}

TEST(BpeTokenizer, MergesAcceptThePairSpelling) {
  json j = json::parse(read_text(fixture("gpt2/tokenizer.json")));
  for (json& m : j["model"]["merges"]) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
    }
  }
  const BpeTokenizer pairs = BpeTokenizer::from_json(j.dump(), "pairs");
  const BpeTokenizer strings = BpeTokenizer::load(fixture("gpt2"));
  for (const std::string& text : corpus()) EXPECT_EQ(pairs.encode(text), strings.encode(text)) << text;
}

// ---- pre-tokenizer and Unicode ----

std::vector<SplitPattern> steps_of(const std::string& name) {
  if (name == "deepseek_v3") {
    return {SplitPattern::kDeepSeekDigits, SplitPattern::kDeepSeekCjk, SplitPattern::kDeepSeekMain};
  }
  for (SplitPattern p : {SplitPattern::kGpt2, SplitPattern::kQwen2, SplitPattern::kCl100k, SplitPattern::kO200k}) {
    if (split_pattern_name(p) == name) return {p};
  }
  ADD_FAILURE() << "unknown pattern " << name;
  return {};
}

TEST(Pretokenizer, RecognisesEveryKnownRegexSpelling) {
  const json patterns = json::parse(read_text(fixture("patterns.json")));
  ASSERT_EQ(patterns.size(), 5u);
  for (const auto& [name, regexes] : patterns.items()) {
    const std::vector<SplitPattern> expected = steps_of(name);
    ASSERT_EQ(regexes.size(), expected.size()) << name;
    for (size_t k = 0; k < regexes.size(); ++k) {
      std::string regex = regexes[k].get<std::string>();
      EXPECT_EQ(recognise_split_pattern(regex), expected[k]) << name << " " << regex;
      // The escapes \r and \n and the characters themselves are the same pattern.
      std::string literal;
      for (size_t i = 0; i < regex.size(); ++i) {
        const bool escape = regex[i] == '\\' && i + 1 < regex.size() && (regex[i + 1] == 'r' || regex[i + 1] == 'n');
        if (escape) {
          literal.push_back(regex[++i] == 'r' ? '\r' : '\n');
        } else {
          literal.push_back(regex[i]);
        }
      }
      EXPECT_EQ(recognise_split_pattern(literal), expected[k]) << name << " with literal CR/LF";
    }
  }
  EXPECT_FALSE(recognise_split_pattern(R"(\p{L}+|\s+)").has_value());
  EXPECT_FALSE(recognise_split_pattern("").has_value());
}

TEST(Pretokenizer, SplitsMatchTokenizersPreTokenizeStr) {
  size_t rows = 0;
  for (const json& row : read_jsonl(fixture("splits.jsonl"))) {
    const std::string text = row["text"].get<std::string>();
    CodePointText cps;
    cps.assign(text);
    std::vector<std::pair<uint32_t, uint32_t>> pieces{{0, static_cast<uint32_t>(cps.size())}}, next;
    for (SplitPattern p : steps_of(row["pattern"].get<std::string>())) {
      next.clear();
      for (const auto& [b, e] : pieces) split_isolated(p, cps, b, e, next);
      std::swap(pieces, next);
    }
    std::vector<std::string> got;
    for (const auto& [b, e] : pieces) got.push_back(text.substr(cps.offset[b], cps.offset[e] - cps.offset[b]));
    EXPECT_EQ(got, row["pieces"].get<std::vector<std::string>>()) << row["pattern"] << " on " << json(text).dump();
    ++rows;
  }
  EXPECT_GT(rows, 500u);
}

TEST(Unicode, NfcMatchesUnicodedata) {
  for (const json& row : read_jsonl(fixture("nfc.jsonl"))) {
    const std::string text = row["text"].get<std::string>(), expected = row["nfc"].get<std::string>();
    EXPECT_EQ(unicode::nfc(text), expected) << json(text).dump();
    EXPECT_EQ(unicode::nfc(expected), expected) << "NFC is idempotent on " << json(expected).dump();
    if (text != expected) {
      EXPECT_FALSE(unicode::is_nfc_quick(text)) << json(text).dump();
    }
  }
  EXPECT_TRUE(unicode::is_nfc_quick("plain ASCII"));
  EXPECT_TRUE(unicode::is_nfc_quick("caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87"));
}

TEST(Unicode, CategoriesAndProperties) {
  using unicode::Category;
  const auto cat = [](char32_t cp) { return unicode::category(unicode::properties(cp)); };
  EXPECT_EQ(cat('A'), Category::Lu);
  EXPECT_EQ(cat('a'), Category::Ll);
  EXPECT_EQ(cat('7'), Category::Nd);
  EXPECT_EQ(cat(0x0301), Category::Mn);
  EXPECT_EQ(cat(0x4E2D), Category::Lo);
  EXPECT_EQ(cat(0x01C5), Category::Lt);
  EXPECT_EQ(cat(0x02B0), Category::Lm);
  EXPECT_EQ(cat(0x1F600), Category::So);
  EXPECT_EQ(cat(0x0378), Category::Cn);  // unassigned
  for (char32_t ws : {U' ', U'\t', U'\n', U'\r', char32_t{0x85}, char32_t{0xA0}, char32_t{0x3000}}) {
    EXPECT_TRUE(unicode::properties(ws) & unicode::kWhiteSpaceBit) << static_cast<uint32_t>(ws);
  }
  EXPECT_FALSE(unicode::properties(0x200B) & unicode::kWhiteSpaceBit);  // ZERO WIDTH SPACE is Cf, not White_Space
  EXPECT_TRUE(unicode::properties(0x0345) & unicode::kAlphabeticBit);   // a mark that is Alphabetic
  EXPECT_FALSE(unicode::properties(0x0301) & unicode::kAlphabeticBit);
  EXPECT_STREQ(unicode::unicode_version(), "14.0.0");
}

TEST(Unicode, RejectsMalformedUtf8) {
  int n = 0;
  expect_error([&] { unicode::decode_utf8("a\xc3", 1, &n); }, {"malformed UTF-8", "byte 1"});
  expect_error([&] { unicode::decode_utf8("\xc0\xaf", 0, &n); }, {"malformed UTF-8", "overlong"});
  expect_error([&] { unicode::decode_utf8("\xed\xa0\x80", 0, &n); }, {"malformed UTF-8", "surrogate"});
}

// ---- refusals ----

json fixture_json() { return json::parse(read_text(fixture("qwen/tokenizer.json"))); }

void expect_refused(const std::function<void(json&)>& edit, std::initializer_list<std::string_view> words) {
  json j = fixture_json();
  edit(j);
  expect_error([&] { BpeTokenizer::from_json(j.dump(), "tok.json"); }, words);
}

TEST(BpeTokenizer, RejectsMalformedFiles) {
  expect_error([] { BpeTokenizer::from_json("{\"model\": ", "tok.json"); }, {"tok.json", "not JSON"});
  expect_error([] { BpeTokenizer::from_json("[1]", "tok.json"); }, {"tok.json", "JSON array"});
  expect_refused([](json& j) { j.erase("model"); }, {"tok.json", "no \"model\""});
  expect_refused([](json& j) { j["model"].erase("vocab"); }, {"no \"vocab\""});
  expect_refused([](json& j) { j["model"]["merges"] = 3; }, {"no \"merges\" array"});
  expect_refused([](json& j) { j["model"]["merges"][5] = "\xc4\xa0t zzzunknown"; },
                 {"merges[5]", "names the right token \"zzzunknown\"", "not in model.vocab"});
  expect_refused([](json& j) { j["model"]["merges"][0] = "a b c"; }, {"merges[0]", "one space"});
  expect_refused([](json& j) { j["model"]["vocab"]["a"] = -4; }, {"vocab[\"a\"]", "-4"});
  expect_refused([](json& j) { j["added_tokens"][0].erase("content"); }, {"added_tokens[0]", "content"});
  expect_error([] { BpeTokenizer::load("/nonexistent/folder"); }, {"cannot open", "/nonexistent/folder"});
}

TEST(BpeTokenizer, RejectsWhatItDoesNotImplementByName) {
  expect_refused([](json& j) { j["model"]["type"] = "WordPiece"; },
                 {"model type 'WordPiece' is not supported", "supported: BPE"});
  expect_refused(
      [](json& j) {
        j["pre_tokenizer"] = json{{"type", "Metaspace"}, {"replacement", "_"}};
      },
      {"pre_tokenizer type 'Metaspace' is not supported", "supported:", "ByteLevel"});
  expect_refused([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{L}+|\\s+"; },
                 {"the Split regex \"\\\\p{L}+|\\\\s+\"", "qwen2", "o200k", "deepseek_v3", "general regex engine"});
  expect_refused([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
                 {"behavior \"Removed\"", "Isolated"});
  expect_refused([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }, {"invert"});
  expect_refused(
      [](json& j) {
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = json{{"String", " "}};
      },
      {"Split pattern", "String", "Regex"});
  expect_refused([](json& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; },
                 {"no ByteLevel", "byte-level BPE"});
  expect_refused([](json& j) { j["pre_tokenizer"] = nullptr; }, {"no pre_tokenizer"});
  expect_refused([](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
                 {"add_prefix_space true"});
  expect_refused(
      [](json& j) {
        j["normalizer"] = json{{"type", "NFKC"}};
      },
      {"normalizer type 'NFKC' is not supported", "NFC"});
  expect_refused(
      [](json& j) {
        j["normalizer"] =
            json{{"type", "Sequence"}, {"normalizers", {json{{"type", "NFC"}}, json{{"type", "Lowercase"}}}}};
      },
      {"normalizers[1]", "'Lowercase'"});
  expect_refused([](json& j) { j["model"]["byte_fallback"] = true; }, {"byte_fallback"});
  expect_refused([](json& j) { j["model"]["dropout"] = 0.1; }, {"dropout"});
  expect_refused([](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, {"continuing_subword_prefix"});
}

TEST(BpeTokenizer, NotesAPostProcessorThatWouldAddTokens) {
  json j = fixture_json();
  j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [], "pair": [],
      "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}})");
  const BpeTokenizer tok = BpeTokenizer::from_json(j.dump(), "tok.json");
  EXPECT_NE(tok.post_processor_note().find("TemplateProcessing, adding <|im_start|>"), std::string::npos)
      << tok.post_processor_note();
  EXPECT_EQ(tok.encode("hi"), BpeTokenizer::load(fixture("qwen")).encode("hi"));  // nothing added
}

// ---- the EOD rule ----

TEST(ChooseEod, PrefersTheFlagThenEndOfTextThenTokenizerConfig) {
  const BpeTokenizer qwen = BpeTokenizer::load(fixture("qwen"));
  EXPECT_EQ(choose_eod(qwen, fixture("qwen"), std::nullopt).id, 0);
  EXPECT_EQ(choose_eod(qwen, fixture("qwen"), 2).id, 2);
  EXPECT_EQ(choose_eod(qwen, fixture("qwen"), 2).source, "--eod");
  expect_error([&] { choose_eod(qwen, fixture("qwen"), 2005); }, {"--eod 2005", "[0, 2004)"});

  // Without <|endoftext|>: the eos_token of tokenizer_config.json beside tokenizer.json.
  const std::string dir = testing::make_temp_dir("eod");
  json j = fixture_json();
  j["added_tokens"].erase(0);
  write_text(dir + "/tokenizer.json", j.dump());
  const BpeTokenizer no_eot = BpeTokenizer::load(dir);
  expect_error([&] { choose_eod(no_eot, dir, std::nullopt); }, {"no end-of-document token", "pass --eod"});
  write_text(dir + "/tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>", "special": true}})");
  EXPECT_EQ(choose_eod(no_eot, dir + "/tokenizer.json", std::nullopt).id, 2);
  write_text(dir + "/tokenizer_config.json", R"({"eos_token": "<|absent|>"})");
  expect_error([&] { choose_eod(no_eot, dir, std::nullopt); }, {"eos_token \"<|absent|>\"", "pass --eod"});
}

// ---- data prepare --tokenizer ----

PrepareOptions tokenizer_options(const std::string& dir) {
  PrepareOptions options;
  options.tokenizer = fixture("qwen");
  options.input = fixture("corpus.jsonl");
  options.text_field = "text";
  options.output = dir + "/out/corpus";
  options.threads = 2;
  return options;
}

TEST(DataPrepareTokenizer, WritesTokenizersIdsAndTheEod) {
  const std::string dir = testing::make_temp_dir("prepare_bpe");
  PrepareOptions options = tokenizer_options(dir);
  int reports = 0;
  options.progress = [&](const PrepareProgress& p) { reports += p.final ? 1 : 0; };
  const PrepareSummary summary = prepare_dataset(options);
  EXPECT_EQ(reports, 1);
  std::vector<std::vector<int32_t>> expected;
  for (const json& row : read_jsonl(fixture("qwen/expected_ids.jsonl"))) {
    std::vector<int32_t> ids = row["ids"].get<std::vector<int32_t>>();
    if (ids.empty()) continue;  // an empty document is skipped
    ids.push_back(0);           // <|endoftext|>
    expected.push_back(ids);
  }
  EXPECT_EQ(summary.skipped_empty, 1);
  EXPECT_EQ(summary.documents, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(summary.eod, 0);
  EXPECT_EQ(summary.dtype, IndexDType::UInt16);
  EXPECT_EQ(summary.input_bytes, static_cast<int64_t>(fs::file_size(fixture("corpus.jsonl"))));
  const IndexedDataset ds = IndexedDataset::open(options.output);
  ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < ds.num_sequences(); ++i) EXPECT_EQ(ds.read(i), expected[i]) << "sequence " << i;

  // One thread, an explicit EOD and dtype: the same ids.
  options.threads = 1;
  options.eod = 2;
  options.dtype = "int32";
  options.output = dir + "/one/corpus";
  prepare_dataset(options);
  const IndexedDataset one = IndexedDataset::open(options.output);
  EXPECT_EQ(one.dtype(), IndexDType::Int32);
  std::vector<int32_t> first = expected[0];
  first.back() = 2;
  EXPECT_EQ(one.read(0), first);
}

// Runs prepare and expects an error naming every word, and nothing left in the output folder.
void expect_prepare_refused(const std::function<void(PrepareOptions&, const std::string& dir)>& adjust,
                            std::initializer_list<std::string_view> words) {
  const std::string dir = testing::make_temp_dir("prepare_bpe_bad");
  PrepareOptions options = tokenizer_options(dir);
  adjust(options, dir);
  expect_error([&] { prepare_dataset(options); }, words);
  EXPECT_FALSE(fs::exists(dir + "/out")) << "a refused run left output behind";
}

TEST(DataPrepareTokenizer, RefusalsWriteNothing) {
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        write_text(dir + "/tokenizer.json", "{\"model\": {\"type\": \"BPE\"");
        o.tokenizer = dir;
      },
      {"tokenizer.json", "not JSON"});
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        json j = fixture_json();
        j["pre_tokenizer"]["pretokenizers"][0] = json{{"type", "Whitespace"}};
        write_text(dir + "/tokenizer.json", j.dump());
        o.tokenizer = dir + "/tokenizer.json";
      },
      {"pre_tokenizer type 'Whitespace' is not supported"});
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        json j = fixture_json();
        j["added_tokens"].erase(0);
        write_text(dir + "/tokenizer.json", j.dump());
        o.tokenizer = dir;
      },
      {"no end-of-document token", "pass --eod"});
  // A bad line after good ones: the documents before it were encoded, and still nothing is left.
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        std::string text = read_text(fixture("corpus.jsonl"));
        text += "{\"text\": 5}\n";
        write_text(dir + "/in.jsonl", text);
        o.input = dir + "/in.jsonl";
      },
      {"in.jsonl:128", "field \"text\" is number"});
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        write_text(dir + "/in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"\n");
        o.input = dir + "/in.jsonl";
      },
      {"in.jsonl:2", "not JSON"});
  expect_prepare_refused(
      [](PrepareOptions& o, const std::string& dir) {
        write_text(dir + "/in.jsonl", "{\"text\": \"\"}\n");
        o.input = dir + "/in.jsonl";
      },
      {"empty input", "1 empty ones skipped"});
  expect_prepare_refused([](PrepareOptions& o, const std::string&) { o.dtype = "uint8"; }, {"--dtype", "uint8"});
  expect_prepare_refused([](PrepareOptions& o, const std::string&) { o.text_files = {o.input}; }, {"not --text"});
}

TEST(DataCommand, PreparesWithATokenizer) {
  const std::string dir = testing::make_temp_dir("data_command_bpe");
  write_text(dir + "/in.jsonl", "{\"body\": \"Hello world<|im_end|>\"}\n");
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  app.parse("data prepare --tokenizer " + fixture("qwen") + " --input " + dir +
                "/in.jsonl --text-field body --threads 1 --eod 2 --output " + dir + "/c",
            false);
  ASSERT_TRUE(command);
  EXPECT_EQ(command(), 0);
  std::vector<int32_t> expected = BpeTokenizer::load(fixture("qwen")).encode("Hello world<|im_end|>");
  expected.push_back(2);
  EXPECT_EQ(IndexedDataset::open(dir + "/c").read(0), expected);
}

TEST(DataCommand, RejectsATokenizerWithTokenIds) {
  CLI::App app;
  std::function<int()> command;
  cli::add_data_command(app, command);
  EXPECT_THROW(app.parse("data prepare --tokenizer t.json --input a.jsonl --field ids --output c", false),
               CLI::ParseError);
  EXPECT_FALSE(command);
}

}  // namespace
}  // namespace moetrain::train::data
