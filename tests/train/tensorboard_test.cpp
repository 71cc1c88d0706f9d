// Tests for train/tensorboard and the TensorBoard side of train/metrics: CRC32C against published vectors, the
// TFRecord framing, an event file written by MetricsLog read back by a small reader here (framing, both CRCs, the
// Event and Summary protobuf fields), the JSONL keys eval_loss / eval_tokens / layer_load_balance, a folder that is a
// file refused, and TensorBoard's own reader (scripts/check_tensorboard.py) on the file when tensorboard is
// importable (skipped otherwise).
#include "train/tensorboard.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "testing/test_data.h"
#include "train/metrics.h"

namespace moetrain::train {
namespace {

namespace fs = std::filesystem;

// RFC 3720 (iSCSI) appendix B.4 and the usual check value.
TEST(TensorBoard, Crc32cMatchesKnownVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0x00000000u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[static_cast<size_t>(i)] = static_cast<char>(i);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  // Continuing a CRC over a second part gives the CRC of the whole.
  EXPECT_EQ(crc32c("56789", crc32c("1234")), 0xE3069283u);
  // The mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8, for crc = 0xE3069283.
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
}

uint64_t read_le(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(bytes.at(at + static_cast<size_t>(i)));
  return v;
}

TEST(TensorBoard, RecordFramingHoldsTheLengthTheDataAndBothMaskedCrcs) {
  const std::string data = "hello, event";
  const std::string record = tfrecord(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(read_le(record, 0, 8), data.size());
  EXPECT_EQ(read_le(record, 8, 4), masked_crc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(read_le(record, 12 + data.size(), 4), masked_crc32c(data));
}

// ---- a small reader: TFRecords and the protobuf wire format ----

struct Field {
  int number = 0;
  int wire = 0;
  uint64_t integer = 0;  // varint, fixed64 or fixed32
  std::string bytes;     // length-delimited
};

uint64_t read_varint(const std::string& b, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; shift < 70; shift += 7) {
    const auto byte = static_cast<uint8_t>(b.at(at++));
    v |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) return v;
  }
  ADD_FAILURE() << "varint longer than 10 bytes";
  return v;
}

std::vector<Field> parse_message(const std::string& b) {
  std::vector<Field> fields;
  size_t at = 0;
  while (at < b.size()) {
    const uint64_t key = read_varint(b, at);
    Field f;
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    switch (f.wire) {
      case 0: f.integer = read_varint(b, at); break;
      case 1: f.integer = read_le(b, at, 8), at += 8; break;
      case 5: f.integer = read_le(b, at, 4), at += 4; break;
      case 2: {
        const uint64_t n = read_varint(b, at);
        f.bytes = b.substr(at, n);
        EXPECT_EQ(f.bytes.size(), n) << "a length-delimited field runs past the message";
        at += n;
        break;
      }
      default: ADD_FAILURE() << "wire type " << f.wire; return fields;
    }
    fields.push_back(std::move(f));
  }
  return fields;
}

struct Event {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

// Every record of an event file, with its framing and CRCs checked.
std::vector<Event> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "a truncated record header";
    if (at + 12 > file.size()) break;
    const uint64_t length = read_le(file, at, 8);
    EXPECT_EQ(read_le(file, at + 8, 4), masked_crc32c(file.substr(at, 8))) << "length CRC at byte " << at;
    EXPECT_LE(at + 12 + length + 4, file.size()) << "a truncated record";
    if (at + 12 + length + 4 > file.size()) break;
    const std::string data = file.substr(at + 12, length);
    EXPECT_EQ(read_le(file, at + 12 + length, 4), masked_crc32c(data)) << "data CRC at byte " << at;
    at += 12 + length + 4;
    Event e;
    for (const Field& f : parse_message(data)) {
      if (f.number == 1 && f.wire == 1)
        std::memcpy(&e.wall_time, &f.integer, 8);
      else if (f.number == 2 && f.wire == 0)
        e.step = static_cast<int64_t>(f.integer);
      else if (f.number == 3 && f.wire == 2)
        e.file_version = f.bytes;
      else if (f.number == 5 && f.wire == 2) {
        for (const Field& value : parse_message(f.bytes)) {
          EXPECT_EQ(value.number, 1);
          std::string tag;
          float simple = 0;
          for (const Field& v : parse_message(value.bytes)) {
            if (v.number == 1 && v.wire == 2) tag = v.bytes;
            if (v.number == 2 && v.wire == 5) {
              const auto bits = static_cast<uint32_t>(v.integer);
              std::memcpy(&simple, &bits, 4);
            }
          }
          e.values.emplace_back(tag, simple);
        }
      } else {
        ADD_FAILURE() << "unexpected Event field " << f.number << " (wire type " << f.wire << ")";
      }
    }
    events.push_back(std::move(e));
  }
  return events;
}

StepMetrics a_step(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.total_steps = 3;
  m.loss = 2.5 - 0.25 * static_cast<double>(step);
  m.lb_loss = 1.125;
  m.z_loss = 4.0;
  m.grad_norm = 0.75;
  m.lr = 1e-3;
  m.tokens = 64;
  m.tokens_per_s = 1000.0;
  m.tflops = 2.0;
  m.mfu = 0.25;
  m.peak_mem_bytes = int64_t{3} << 29;  // 1.5 GiB
  m.layer_load_balance = {1.0, 1.5, 2.25};
  if (step == 2) {
    m.has_eval = true;
    m.eval_loss = 3.0;
    m.eval_tokens = 4096;
  }
  return m;
}

// The folder of event files of a MetricsLog that recorded steps 1..3 (an evaluation at step 2).
std::string write_three_steps(const std::string& tag) {
  const std::string dir = testing::make_temp_dir(tag) + "/tb";
  MetricsLog log("", 0, dir);
  for (int64_t step = 1; step <= 3; ++step) log.record(a_step(step));
  return dir;
}

std::string only_file_in(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path().string());
  EXPECT_EQ(files.size(), 1u);
  return files.empty() ? std::string() : files[0];
}

TEST(TensorBoard, MetricsLogWritesAnEventFileThatReadsBack) {
  const std::string dir = write_three_steps("tb_readback");
  const std::string path = only_file_in(dir);
  const std::string name = fs::path(path).filename().string();
  EXPECT_TRUE(name.starts_with("events.out.tfevents.")) << name;
  EXPECT_TRUE(name.ends_with(".moetrain")) << name;
  const std::vector<Event> events = read_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.5e9) << "unix seconds";
  for (int64_t step = 1; step <= 3; ++step) {
    const Event& e = events[static_cast<size_t>(step)];
    EXPECT_EQ(e.step, step);
    EXPECT_GE(e.wall_time, events[0].wall_time);
    std::map<std::string, float> values(e.values.begin(), e.values.end());
    EXPECT_EQ(values.size(), e.values.size()) << "a tag written twice";
    const StepMetrics m = a_step(step);
    EXPECT_EQ(values.at("train/loss"), static_cast<float>(m.loss));
    EXPECT_EQ(values.at("train/lb_loss"), 1.125f);
    EXPECT_EQ(values.at("train/z_loss"), 4.0f);
    EXPECT_EQ(values.at("train/lr"), 1e-3f);
    EXPECT_EQ(values.at("train/grad_norm"), 0.75f);
    EXPECT_EQ(values.at("perf/tokens_per_s"), 1000.0f);
    EXPECT_EQ(values.at("perf/tflops"), 2.0f);
    EXPECT_EQ(values.at("perf/mfu"), 0.25f);
    EXPECT_EQ(values.at("mem/peak_gib"), 1.5f);
    EXPECT_EQ(values.at("balance/layer_00"), 1.0f);
    EXPECT_EQ(values.at("balance/layer_01"), 1.5f);
    EXPECT_EQ(values.at("balance/layer_02"), 2.25f);
    EXPECT_EQ(values.count("train/device_balance"), 0u) << "reported only when on";
    EXPECT_EQ(values.count("eval/loss"), step == 2 ? 1u : 0u);
    if (step == 2) {
      EXPECT_EQ(values.at("eval/loss"), 3.0f);
      EXPECT_EQ(values.at("eval/tokens"), 4096.0f);
    }
  }
}

TEST(TensorBoard, RefusesAFolderThatIsAFile) {
  const std::string file = testing::make_temp_dir("tb_file") + "/not_a_folder";
  std::ofstream(file) << "x";
  try {
    TensorBoardWriter writer(file);
    ADD_FAILURE() << "a file was taken for the event folder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a folder"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
}

TEST(Metrics, JsonlHoldsEvalAndLayerLoadBalanceWhenThereAreAny) {
  const nlohmann::json with = nlohmann::json::parse(format_jsonl_record(a_step(2)));
  EXPECT_EQ(with.at("eval_loss").get<double>(), 3.0);
  EXPECT_EQ(with.at("eval_tokens").get<int64_t>(), 4096);
  EXPECT_EQ(with.at("layer_load_balance").get<std::vector<double>>(), (std::vector<double>{1.0, 1.5, 2.25}));
  StepMetrics dense = a_step(1);
  dense.layer_load_balance.clear();
  const nlohmann::json without = nlohmann::json::parse(format_jsonl_record(dense));
  EXPECT_FALSE(without.contains("eval_loss")) << without.dump();
  EXPECT_FALSE(without.contains("eval_tokens")) << without.dump();
  EXPECT_FALSE(without.contains("layer_load_balance")) << without.dump();
  EXPECT_EQ(format_eval_line(a_step(2)), "step 2/3 | eval loss 3.0000 over 4096 tokens (0.0s)");
}

// A Python that imports tensorboard: $MOETRAIN_TB_PYTHON, /work/venv-tb/bin/python, then python3; empty if none.
std::string tensorboard_python() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MOETRAIN_TB_PYTHON")) candidates.emplace_back(env);
  candidates.emplace_back("/work/venv-tb/bin/python");
  candidates.emplace_back("python3");
  for (const std::string& python : candidates) {
    if (python.find('/') != std::string::npos && !fs::exists(python)) continue;
    const std::string probe = "'" + python + "' -c 'import tensorboard' > /dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return python;
  }
  return "";
}

// TensorBoard's own reader (EventAccumulator, through scripts/check_tensorboard.py) parses the file and finds every
// scalar at its step.
TEST(TensorBoard, TensorBoardsOwnReaderParsesTheFile) {
  const std::string python = tensorboard_python();
  if (python.empty()) {
    GTEST_SKIP() << "tensorboard is not importable (tried $MOETRAIN_TB_PYTHON, /work/venv-tb/bin/python, python3); "
                    "pip install tensorboard to run this check";
  }
  const std::string dir = write_three_steps("tb_tensorboard");
  const std::string script = testing::repo_path("scripts/check_tensorboard.py");
  const std::string command = "'" + python + "' '" + script + "' '" + dir + "' 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), &pclose);
  ASSERT_NE(pipe, nullptr);
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe.get())) output.append(buffer.data(), n);
  ASSERT_EQ(pclose(pipe.release()), 0) << output;
  // The script prints one JSON line last (TensorBoard may log warnings before it).
  const size_t last_line = output.rfind('\n', output.size() >= 2 ? output.size() - 2 : 0);
  const nlohmann::json scalars =
      nlohmann::json::parse(last_line == std::string::npos ? output : output.substr(last_line + 1));
  // {tag: [[step, value], ...]}
  ASSERT_TRUE(scalars.contains("train/loss")) << output;
  EXPECT_EQ(scalars.at("train/loss").size(), 3u) << output;
  for (int64_t step = 1; step <= 3; ++step) {
    const nlohmann::json& point = scalars.at("train/loss")[static_cast<size_t>(step - 1)];
    EXPECT_EQ(point[0].get<int64_t>(), step);
    EXPECT_EQ(point[1].get<float>(), static_cast<float>(a_step(step).loss));
  }
  ASSERT_TRUE(scalars.contains("eval/loss")) << output;
  ASSERT_EQ(scalars.at("eval/loss").size(), 1u) << output;
  EXPECT_EQ(scalars.at("eval/loss")[0][0].get<int64_t>(), 2);
  EXPECT_EQ(scalars.at("eval/loss")[0][1].get<double>(), 3.0);
  EXPECT_EQ(scalars.at("balance/layer_02")[2][1].get<double>(), 2.25);
  EXPECT_EQ(scalars.at("mem/peak_gib")[0][1].get<double>(), 1.5);
}

}  // namespace
}  // namespace moetrain::train
