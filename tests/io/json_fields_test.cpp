// Tests for io/json_fields: typed field reads that name the file and the field, and the bounded JSON file reader
// (regular files only, a size limit checked before reading, no NUL and nothing after the document).
#include "io/json_fields.h"

#include <sys/stat.h>

#include <fstream>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "core/error.h"
#include "testing/test_data.h"

namespace moetrain::io {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(JsonFields, ReadsTypedFieldsAndNamesTheFieldOnAMismatch) {
  const nlohmann::json j = nlohmann::json::parse(R"({"n": 3, "x": 0.5, "b": true, "s": "a", "l": [1, 2],
                                                     "o": {"k": 7}, "z": null})");
  const JsonFields f(j, "test.json");
  EXPECT_EQ(f.require_int("n"), 3);
  EXPECT_EQ(f.require_number("x"), 0.5);
  EXPECT_EQ(f.bool_opt("b"), true);
  EXPECT_EQ(f.require_string("s"), "a");
  EXPECT_EQ(f.int_list_opt("l"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(f.object_opt("o")->require_int("k"), 7);
  EXPECT_FALSE(f.int_opt("z").has_value()) << "null counts as absent";
  EXPECT_FALSE(f.object_opt("missing").has_value());
  const std::string wrong = error_of([&] { f.require_int("s"); });
  EXPECT_TRUE(contains(wrong, "test.json") && contains(wrong, "'s'") && contains(wrong, "integer")) << wrong;
  const std::string nested = error_of([&] { f.object_opt("o")->require_string("k"); });
  EXPECT_TRUE(contains(nested, "'o.k'")) << nested;
  const std::string missing = error_of([&] { f.require_number("q"); });
  EXPECT_TRUE(contains(missing, "required field 'q' is missing")) << missing;
  const std::string null = error_of([&] { f.require_int("z"); });
  EXPECT_TRUE(contains(null, "'z' is null")) << null;
}

TEST(JsonFields, ParseRefusesNulTrailingBytesAndNonObjects) {
  EXPECT_TRUE(contains(error_of([] { parse_json_object(std::string("{}\0GARBAGE", 10), "nul.json"); }), "NUL"));
  EXPECT_TRUE(contains(error_of([] { parse_json_object("{} {}", "two.json"); }), "two.json"));
  EXPECT_TRUE(contains(error_of([] { parse_json_object("[1]", "array.json"); }), "expected a JSON object"));
  EXPECT_TRUE(contains(error_of([] { parse_json_object("{\"a\": 1e400}", "big.json"); }), "big.json"));
  EXPECT_EQ(parse_json_object("{\"a\": 1}", "ok.json").at("a"), 1);
}

TEST(JsonFields, ReadRefusesWhatIsNotARegularFileOrTooLarge) {
  const std::string dir = testing::make_temp_dir("json_fields");
  EXPECT_TRUE(contains(error_of([&] { read_json_object(dir + "/absent.json"); }), "does not exist"));
  EXPECT_TRUE(contains(error_of([&] { read_json_object(dir); }), "a directory"));
  const std::string fifo = dir + "/fifo.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // Refused from its type alone: opening a FIFO with no writer would block forever.
  EXPECT_TRUE(contains(error_of([&] { read_json_object(fifo); }), "FIFO"));
  const std::string big = dir + "/big.json";
  std::ofstream(big) << "{\"a\": \"" << std::string(100, 'x') << "\"}";
  EXPECT_TRUE(contains(error_of([&] { read_json_object(big, 64); }), "more than the 64 bytes"));
  EXPECT_EQ(read_json_object(big).at("a").get<std::string>().size(), 100u);
}

// Issue 20: every size a config gives is bounded (2^24 by default), so a huge one is refused naming the field.
TEST(JsonFields, CheckPositiveBoundsTheValueAndCheckRangeNamesTheRange) {
  const nlohmann::json j = nlohmann::json::object();
  const JsonFields f(j, "config.json", "rope.");
  EXPECT_NO_THROW(f.check_positive(kMaxConfigExtent, "hidden_size"));
  const std::string huge = error_of([&] { f.check_positive(int64_t{1} << 62, "hidden_size"); });
  EXPECT_TRUE(contains(huge, "config.json: rope.hidden_size is 4611686018427387904, more than the 16777216")) << huge;
  const std::string tight = error_of([&] { f.check_positive(70000, "num_experts", 65536); });
  EXPECT_TRUE(contains(tight, "num_experts is 70000, more than the 65536")) << tight;
  EXPECT_TRUE(contains(error_of([&] { f.check_positive(0, "n"); }), "must be positive but is 0"));
  const std::string range = error_of([&] { f.check_range(9, "k", 1, 8); });
  EXPECT_TRUE(contains(range, "config.json: rope.k is 9, expected a value in [1, 8]")) << range;
  EXPECT_NO_THROW(f.check_range(8, "k", 1, 8));
}

TEST(JsonFields, ReadBoundedFileRefusesAFifoBeforeOpeningIt) {
  const std::string dir = testing::make_temp_dir("json_fields_fifo");
  ASSERT_EQ(::mkfifo((dir + "/input").c_str(), 0600), 0);
  const std::string fifo = error_of([&] { read_bounded_file(dir + "/input", 1 << 20); });
  EXPECT_TRUE(contains(fifo, dir + "/input") && contains(fifo, "FIFO")) << fifo;
  std::ofstream(dir + "/big") << std::string(100, 'x');
  const std::string big = error_of([&] { read_bounded_file(dir + "/big", 99); });
  EXPECT_TRUE(contains(big, "100 bytes is more than the 99")) << big;
  EXPECT_EQ(read_bounded_file(dir + "/big", 100).size(), 100u);
}

}  // namespace
}  // namespace moetrain::io
