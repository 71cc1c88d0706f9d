// Tests for train/checkpoint: byte-exact round trips, the manifest, rotation, every kind of
// half-written or corrupt checkpoint, a process killed during a write, and bad arguments.
#include "train/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <tuple>

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::train {
namespace {

using testing::expect_error;

namespace fs = std::filesystem;
using nlohmann::json;
using Named = std::vector<std::pair<std::string, Tensor>>;

// Removes a test folder at the end of a test (the crash tests write tens of megabytes).
struct ScopedDir {
  explicit ScopedDir(const std::string& tag) : path(testing::make_temp_dir(tag)) {}
  ~ScopedDir() {
    std::error_code error;
    fs::remove_all(path, error);
  }
  std::string path;
};

// A tensor whose bytes follow a pattern that depends on `seed`.
Tensor patterned(const Shape& shape, DType dtype, int seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = uint8_t(i * 31 + seed * 7 + 3);
  return t;
}

// A small checkpoint whose every part depends on `step`. Names are deliberately not sorted, to
// pin that the saved order comes back. `big` (if defined) is added to the model and the optimizer.
CheckpointData make_data(int64_t step, const Tensor& big = Tensor()) {
  const int seed = static_cast<int>(step);
  CheckpointData data;
  data.step = step;
  data.model = {{"model.layers.0.mlp.up_proj.weight", patterned({6, 4}, DType::F32, seed)},
                {"lm_head.weight", patterned({5, 3}, DType::BF16, seed + 1)},
                {"model.norm.weight", patterned({3}, DType::F64, seed + 2)},
                {"model.empty", patterned({0, 4}, DType::F32, seed + 3)},
                {"model.embed_tokens.weight", patterned({7, 2}, DType::F16, seed + 4)}};
  data.optimizer = {{"exp_avg_sq.0", patterned({6, 4}, DType::F32, seed + 5)},
                    {"exp_avg.0", patterned({6, 4}, DType::F32, seed + 6)},
                    {"steps", patterned({}, DType::I64, seed + 7)}};
  if (big.defined()) {
    data.model.emplace_back("big", big);
    data.optimizer.emplace_back("big_moment", big);
  }
  data.state = {{"step", step},
                {"rng", {{"seed", 1234}, {"offset", step * 7}}},
                {"loader", {{"shard", 3}, {"position", 98765 + step}}},
                {"note", "caf\u00e9"}};
  data.config_toml = "[model]\nhidden = 64\n\n[train]\n# written at step " + std::to_string(step) + "\n";
  return data;
}

void expect_same_tensors(const Named& actual, const Named& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& [name, tensor] = expected[i];
    EXPECT_EQ(actual[i].first, name) << what << " tensor " << i;
    EXPECT_EQ(actual[i].second.dtype(), tensor.dtype()) << name;
    EXPECT_EQ(actual[i].second.shape(), tensor.shape()) << name;
    ASSERT_EQ(actual[i].second.nbytes(), tensor.nbytes()) << name;
    if (tensor.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(actual[i].second.raw_data(), tensor.raw_data(), tensor.nbytes()), 0)
          << name << ": bytes differ";
    }
  }
}

void expect_same_data(const CheckpointData& actual, const CheckpointData& expected) {
  EXPECT_EQ(actual.step, expected.step);
  expect_same_tensors(actual.model, expected.model, "model");
  expect_same_tensors(actual.optimizer, expected.optimizer, "optimizer");
  EXPECT_EQ(actual.state, expected.state);
  EXPECT_EQ(actual.config_toml, expected.config_toml);
}

std::string step_path(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool has_temporary_folder(const std::string& dir) {
  const auto names = entries_of(dir);
  return std::any_of(names.begin(), names.end(),
                     [](const std::string& name) { return name.find(".tmp-") != std::string::npos; });
}

// find_latest_checkpoint, also returning what it logged.
std::optional<std::string> find_latest_logging(const std::string& dir, std::string* log) {
  ::testing::internal::CaptureStderr();
  std::optional<std::string> latest = find_latest_checkpoint(dir);
  *log = ::testing::internal::GetCapturedStderr();
  return latest;
}

TEST(Checkpoint, Fnv1a64MatchesReferenceVectors) {
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
}

TEST(Checkpoint, SaveLoadRoundTripsTensorsStateAndConfig) {
  ScopedDir dir("ckpt");
  const CheckpointData data = make_data(42);
  const std::string path = save_checkpoint(dir.path, data, 0);
  EXPECT_EQ(path, step_path(dir.path, 42));
  EXPECT_EQ(entries_of(path), (std::vector<std::string>{"config.toml", "manifest.json", "model.safetensors",
                                                        "optimizer.safetensors", "state.json"}));
  EXPECT_EQ(read_file(path + "/config.toml"), data.config_toml);
  EXPECT_EQ(json::parse(read_file(path + "/state.json")), data.state);

  const CheckpointData loaded = load_checkpoint(path);
  expect_same_data(loaded, data);
}

TEST(Checkpoint, LoadedTensorsAreWritableCopies) {
  ScopedDir dir("ckpt");
  const CheckpointData data = make_data(3);
  const std::string path = save_checkpoint(dir.path, data, 0);
  CheckpointData loaded = load_checkpoint(path);
  for (auto* group : {&loaded.model, &loaded.optimizer}) {
    for (auto& [name, tensor] : *group) {
      if (tensor.nbytes() > 0) std::memset(tensor.raw_data(), 0xAB, tensor.nbytes());  // faults on a mapping
    }
  }
  expect_same_data(load_checkpoint(path), data);  // the files are untouched
}

TEST(Checkpoint, RoundTripsEmptyTensorListsStateAndConfig) {
  ScopedDir dir("ckpt");
  CheckpointData data;
  data.step = 0;
  const std::string path = save_checkpoint(dir.path, data, 0);
  EXPECT_EQ(path, step_path(dir.path, 0));
  expect_same_data(load_checkpoint(path), data);
}

TEST(Checkpoint, ManifestListsFormatStepAndSizeAndHashOfEveryFile) {
  ScopedDir dir("ckpt");
  const std::string path = save_checkpoint(dir.path, make_data(7), 0);
  const json manifest = json::parse(read_file(path + "/manifest.json"));
  EXPECT_EQ(manifest.at("format"), "moetrain-checkpoint");
  EXPECT_EQ(manifest.at("version"), 1);
  EXPECT_EQ(manifest.at("step"), 7);
  ASSERT_EQ(manifest.at("files").size(), 4u);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "state.json", "config.toml"}) {
    const std::string bytes = read_file(path + "/" + name);
    const json& entry = manifest.at("files").at(name);
    EXPECT_EQ(entry.at("bytes").get<uint64_t>(), bytes.size()) << name;
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a64(bytes.data(), bytes.size())));
    EXPECT_EQ(entry.at("fnv1a64").get<std::string>(), hex) << name;
  }
}

TEST(Checkpoint, KeepTwoAfterFourSavesLeavesTheTwoNewest) {
  ScopedDir dir("ckpt");
  for (int64_t step : {100, 200, 300, 400}) save_checkpoint(dir.path, make_data(step), 2);
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{300, 400}));
  EXPECT_EQ(entries_of(dir.path), (std::vector<std::string>{"step_00000300", "step_00000400"}));
  EXPECT_EQ(find_latest_checkpoint(dir.path), step_path(dir.path, 400));
  expect_same_data(load_checkpoint(step_path(dir.path, 300)), make_data(300));
}

TEST(Checkpoint, KeepZeroKeepsEveryCheckpoint) {
  ScopedDir dir("ckpt");
  for (int64_t step : {1, 2, 3, 4}) save_checkpoint(dir.path, make_data(step), 0);
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(Checkpoint, RotationNeverDeletesTheCheckpointJustWritten) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(10), 0);
  save_checkpoint(dir.path, make_data(20), 0);
  save_checkpoint(dir.path, make_data(15), 2);  // an older step saved after a resume from step 10
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{15, 20}));
  save_checkpoint(dir.path, make_data(5), 1);
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{5}));
}

TEST(Checkpoint, StepsPastEightDigitsKeepTheirOrder) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(99'999'999), 0);
  const std::string path = save_checkpoint(dir.path, make_data(123'456'789), 0);
  EXPECT_EQ(fs::path(path).filename(), "step_123456789");
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{99'999'999, 123'456'789}));
  EXPECT_EQ(find_latest_checkpoint(dir.path), path);
}

TEST(Checkpoint, MissingOrEmptyFolderHoldsNoCheckpoint) {
  ScopedDir dir("ckpt");
  EXPECT_EQ(find_latest_checkpoint(dir.path + "/absent"), std::nullopt);
  EXPECT_TRUE(list_checkpoints(dir.path + "/absent").empty());
  EXPECT_EQ(find_latest_checkpoint(dir.path), std::nullopt);
  fs::create_directory(dir.path + "/not_a_step");
  write_file(dir.path + "/step_00000001.json", "{}");
  EXPECT_EQ(find_latest_checkpoint(dir.path), std::nullopt);
}

TEST(Checkpoint, FindLatestOfAFileIsAnError) {
  ScopedDir dir("ckpt");
  write_file(dir.path + "/file", "x");
  expect_error([&] { find_latest_checkpoint(dir.path + "/file"); }, {"file", "is not a folder"});
}

TEST(Checkpoint, TemporaryFolderIsIgnoredAndRemovedByTheNextSave) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(1), 0);
  // A complete copy under a temporary name: a crash between the last fsync and the rename.
  const std::string stale = dir.path + "/step_00000002.tmp-123";
  fs::copy(step_path(dir.path, 1), stale);
  EXPECT_EQ(find_latest_checkpoint(dir.path), step_path(dir.path, 1));
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{1}));

  save_checkpoint(dir.path, make_data(3), 0);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_EQ(list_checkpoints(dir.path), (std::vector<int64_t>{1, 3}));
}

TEST(Checkpoint, FolderWithoutManifestIsSkippedWithAWarning) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(1), 0);
  save_checkpoint(dir.path, make_data(2), 0);
  fs::remove(step_path(dir.path, 2) + "/manifest.json");
  std::string log;
  EXPECT_EQ(find_latest_logging(dir.path, &log), step_path(dir.path, 1));
  EXPECT_NE(log.find(step_path(dir.path, 2)), std::string::npos) << log;
  EXPECT_NE(log.find("manifest.json is missing"), std::string::npos) << log;
  expect_error([&] { load_checkpoint(step_path(dir.path, 2)); }, {"step_00000002", "manifest.json is missing"});
}

TEST(Checkpoint, TruncatedFileIsSkippedBySizeAndRejectedByLoad) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(1), 0);
  save_checkpoint(dir.path, make_data(2), 0);
  const std::string model = step_path(dir.path, 2) + "/model.safetensors";
  const uintmax_t size = fs::file_size(model);
  fs::resize_file(model, size - 10);
  std::string log;
  EXPECT_EQ(find_latest_logging(dir.path, &log), step_path(dir.path, 1));
  EXPECT_NE(log.find(step_path(dir.path, 2)), std::string::npos) << log;
  EXPECT_NE(log.find("model.safetensors has " + std::to_string(size - 10) + " bytes"), std::string::npos) << log;
  expect_error(
      [&] { load_checkpoint(step_path(dir.path, 2)); },
      {"model.safetensors has " + std::to_string(size - 10) + " bytes", "the manifest lists " + std::to_string(size)});
  expect_same_data(load_checkpoint(step_path(dir.path, 1)), make_data(1));
}

TEST(Checkpoint, ManifestWithTheWrongStepIsSkippedAndRejectedByLoad) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(1), 0);
  save_checkpoint(dir.path, make_data(2), 0);
  const std::string manifest_path = step_path(dir.path, 2) + "/manifest.json";
  json manifest = json::parse(read_file(manifest_path));
  manifest["step"] = 3;
  write_file(manifest_path, manifest.dump());
  std::string log;
  EXPECT_EQ(find_latest_logging(dir.path, &log), step_path(dir.path, 1));
  EXPECT_NE(log.find("manifest.json says step 3, the folder name says step 2"), std::string::npos) << log;
  expect_error([&] { load_checkpoint(step_path(dir.path, 2)); },
               {"step_00000002", "manifest.json says step 3, the folder name says step 2"});
}

TEST(Checkpoint, ManifestOfAnotherFormatOrVersionIsSkipped) {
  ScopedDir dir("ckpt");
  save_checkpoint(dir.path, make_data(1), 0);
  save_checkpoint(dir.path, make_data(2), 0);
  save_checkpoint(dir.path, make_data(3), 0);
  for (const auto& [step, key, value] : {std::tuple{2, "format", json("other")}, std::tuple{3, "version", json(2)}}) {
    const std::string manifest_path = step_path(dir.path, step) + "/manifest.json";
    json manifest = json::parse(read_file(manifest_path));
    manifest[key] = value;
    write_file(manifest_path, manifest.dump());
  }
  std::string log;
  EXPECT_EQ(find_latest_logging(dir.path, &log), step_path(dir.path, 1));
  EXPECT_NE(log.find("\"format\" is \"other\", expected \"moetrain-checkpoint\""), std::string::npos) << log;
  EXPECT_NE(log.find("\"version\" is 2, expected 1"), std::string::npos) << log;
  expect_error([&] { load_checkpoint(step_path(dir.path, 3)); }, {"manifest.json", "\"version\" is 2, expected 1"});
}

TEST(Checkpoint, CorruptedByteOfTheSameSizeIsCaughtByLoadNamingTheFile) {
  ScopedDir dir("ckpt");
  const CheckpointData data = make_data(5);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "state.json", "config.toml"}) {
    const std::string path = save_checkpoint(dir.path, data, 0);
    const std::string file = path + "/" + name;
    std::string bytes = read_file(file);
    bytes[bytes.size() - 2] ^= 0x01;  // inside the tensor data or the text, same size
    write_file(file, bytes);
    EXPECT_EQ(find_latest_checkpoint(dir.path), path) << name << ": sizes still match, find_latest does not hash";
    expect_error([&] { load_checkpoint(path); }, {"step_00000005", name, "FNV-1a 64 hash", "corrupt"});
  }
}

TEST(Checkpoint, SavingOverAnExistingStepReplacesIt) {
  ScopedDir dir("ckpt");
  CheckpointData first = make_data(5);
  CheckpointData second = make_data(5);
  second.state["variant"] = "second";
  second.model.erase(second.model.begin());
  save_checkpoint(dir.path, first, 0);
  const std::string path = save_checkpoint(dir.path, second, 0);
  expect_same_data(load_checkpoint(path), second);
  EXPECT_EQ(entries_of(dir.path), (std::vector<std::string>{"step_00000005"}));
}

// Forks a child that saves `data` into `dir` and is killed with SIGKILL after `delay_us`. Returns
// whether the child was caught mid-write (its temporary folder exists after the kill).
bool save_in_child_and_kill(const std::string& dir, const CheckpointData& data, int delay_us, bool* finished) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      save_checkpoint(dir, data, 0);
    } catch (...) {
      ::_exit(1);
    }
    ::_exit(0);
  }
  EXPECT_GT(pid, 0) << "fork failed";
  if (pid <= 0) return false;
  ::usleep(static_cast<useconds_t>(delay_us));
  ::kill(pid, SIGKILL);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  *finished = WIFEXITED(status);
  EXPECT_TRUE(!WIFEXITED(status) || WEXITSTATUS(status) == 0) << "the child's save failed";
  const std::string tmp = step_path(dir, data.step) + ".tmp-" + std::to_string(pid);
  return fs::exists(tmp);
}

Tensor big_tensor() { return patterned({6 << 20}, DType::F32, 9); }  // 24 MiB, in the model and the optimizer

// Saves `data` in this process and returns kill delays spread from "before the first byte" to
// "after the rename", scaled by how long that save took (fsync times differ a lot between disks).
std::vector<int> timed_save_and_kill_delays_us(const std::string& dir, const CheckpointData& data) {
  const auto start = std::chrono::steady_clock::now();
  save_checkpoint(dir, data, 0);
  const double save_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  std::vector<int> delays = {100};
  for (double fraction : {0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.5}) {
    delays.push_back(static_cast<int>(fraction * save_us) + 100);
  }
  return delays;
}

TEST(Checkpoint, KillingTheProcessDuringAWriteLosesNothingButThatCheckpoint) {
  ScopedDir dir("ckpt_crash");
  const Tensor big = big_tensor();
  int64_t latest_step = 2;
  const std::vector<int> delays_us = timed_save_and_kill_delays_us(dir.path, make_data(latest_step, big));
  int mid_write_kills = 0;
  int completed_saves = 0;
  for (size_t i = 0; i < delays_us.size(); ++i) {
    const CheckpointData data = make_data(10 + static_cast<int64_t>(i), big);
    bool finished = false;
    mid_write_kills += save_in_child_and_kill(dir.path, data, delays_us[i], &finished) ? 1 : 0;
    const std::optional<std::string> latest = find_latest_checkpoint(dir.path);
    ASSERT_TRUE(latest.has_value());
    if (finished || *latest == step_path(dir.path, data.step)) {
      // The child got past the rename: its checkpoint is complete and becomes the latest.
      ASSERT_EQ(*latest, step_path(dir.path, data.step)) << "delay " << delays_us[i] << " us";
      expect_same_data(load_checkpoint(*latest), data);
      latest_step = data.step;
      ++completed_saves;
    } else {
      ASSERT_EQ(*latest, step_path(dir.path, latest_step)) << "delay " << delays_us[i] << " us";
      expect_same_data(load_checkpoint(*latest), make_data(latest_step, big));
    }
  }
  RecordProperty("mid_write_kills", mid_write_kills);
  RecordProperty("completed_saves", completed_saves);
  EXPECT_GE(mid_write_kills, 1) << "no kill landed during a write: the test did not test a crash";

  save_checkpoint(dir.path, make_data(1000), 0);
  EXPECT_FALSE(has_temporary_folder(dir.path)) << "a later save removes what the killed ones left";
  EXPECT_EQ(find_latest_checkpoint(dir.path), step_path(dir.path, 1000));
}

TEST(Checkpoint, KillingAnOverwriteLeavesTheOldOrTheNewCheckpointWhole) {
  ScopedDir dir("ckpt_crash");
  const Tensor big = big_tensor();
  CheckpointData old_data = make_data(5, big);
  old_data.state["variant"] = "old";
  const std::vector<int> delays_us = timed_save_and_kill_delays_us(dir.path, old_data);
  CheckpointData new_data = make_data(5, big);
  new_data.state["variant"] = "new";
  new_data.optimizer.pop_back();
  int mid_write_kills = 0;
  int kills_before_replacing = 0;
  for (int delay_us : delays_us) {
    bool finished = false;
    mid_write_kills += save_in_child_and_kill(dir.path, new_data, delay_us, &finished) ? 1 : 0;
    const std::optional<std::string> latest = find_latest_checkpoint(dir.path);
    ASSERT_EQ(latest, step_path(dir.path, 5)) << "delay " << delay_us << " us";
    const CheckpointData loaded = load_checkpoint(*latest);
    const bool replaced = loaded.state.at("variant") == "new";
    EXPECT_TRUE(replaced || !finished) << "the child finished its save but the old checkpoint is still there";
    expect_same_data(loaded, replaced ? new_data : old_data);
    if (replaced) break;  // nothing old left to lose
    ++kills_before_replacing;
  }
  RecordProperty("mid_write_kills", mid_write_kills);
  RecordProperty("kills_before_replacing", kills_before_replacing);
  EXPECT_GE(mid_write_kills, 1) << "no kill landed during a write: the test did not test a crash";
  EXPECT_GE(kills_before_replacing, 1) << "every kill came after the exchange: the old checkpoint was never at risk";
}

TEST(Checkpoint, LoadOfAMissingFolderFails) {
  ScopedDir dir("ckpt");
  expect_error([&] { load_checkpoint(dir.path + "/step_00000001"); }, {"step_00000001", "does not exist"});
}

TEST(Checkpoint, LoadOfAManifestThatIsNotJsonFails) {
  ScopedDir dir("ckpt");
  const std::string path = save_checkpoint(dir.path, make_data(1), 0);
  write_file(path + "/manifest.json", "{\"format\": \"moetrain-checkpoint\", ");
  expect_error([&] { load_checkpoint(path); }, {"step_00000001", "manifest.json is not JSON"});
  std::string log;
  EXPECT_EQ(find_latest_logging(dir.path, &log), std::nullopt);
  EXPECT_NE(log.find("manifest.json is not JSON"), std::string::npos) << log;
}

TEST(Checkpoint, LoadOfAManifestWithABadFileEntryFails) {
  ScopedDir dir("ckpt");
  const std::string path = save_checkpoint(dir.path, make_data(1), 0);
  json manifest = json::parse(read_file(path + "/manifest.json"));
  manifest["files"]["state.json"]["fnv1a64"] = "xyz";
  write_file(path + "/manifest.json", manifest.dump());
  expect_error([&] { load_checkpoint(path); }, {"manifest.json", "entry of state.json", "16 lowercase hex digits"});
  manifest = json::parse(read_file(path + "/manifest.json"));
  manifest["files"]["../escape"] = manifest["files"]["config.toml"];
  write_file(path + "/manifest.json", manifest.dump());
  expect_error([&] { load_checkpoint(path); }, {"manifest.json", "'../escape'", "plain file name"});
}

TEST(Checkpoint, SaveRejectsADeviceTensorBeforeWritingAnything) {
  ScopedDir dir("ckpt");
  CheckpointData data = make_data(1);
  // A tensor that claims to live on a GPU; its bytes are never touched because validation comes first.
  auto host = std::make_shared<std::vector<float>>(8);
  data.optimizer.emplace_back("gpu_moment", Tensor::from_blob(host->data(), {8}, DType::F32, Device::cuda(0), host));
  expect_error([&] { save_checkpoint(dir.path + "/run", data, 0); },
               {"optimizer tensor 'gpu_moment'", "on cuda:0", "expected a contiguous CPU tensor"});
  EXPECT_FALSE(fs::exists(dir.path + "/run"));
}

TEST(Checkpoint, SaveRejectsBadNamesStepAndKeep) {
  ScopedDir dir("ckpt");
  CheckpointData data = make_data(1);
  data.model.push_back(data.model.front());
  expect_error([&] { save_checkpoint(dir.path, data, 0); }, {"model tensor name", "appears twice"});
  data = make_data(1);
  data.optimizer.emplace_back("", patterned({2}, DType::F32, 0));
  expect_error([&] { save_checkpoint(dir.path, data, 0); }, {"optimizer tensor has an empty name"});
  data = make_data(1);
  data.model.emplace_back("undefined", Tensor());
  expect_error([&] { save_checkpoint(dir.path, data, 0); }, {"model tensor 'undefined' is undefined"});
  expect_error([&] { save_checkpoint(dir.path, make_data(-1), 0); }, {"step is -1", "non-negative"});
  expect_error([&] { save_checkpoint(dir.path, make_data(1), -2); }, {"keep is -2", "expected >= 0"});
  EXPECT_TRUE(entries_of(dir.path).empty());
}

// ---- sharded checkpoints ----

// A [2, 3] parameter "w" (HF pieces "a" = row 0, "b" = row 1) and its two moments, split over 2 ranks as 4 + 2
// elements: rank r's file holds its slice of each.
json two_rank_layout() {
  json tensors = json::array();
  for (const char* kind : {"param/", "exp_avg/", "exp_avg_sq/"}) {
    json t = {{"name", std::string(kind) + "w"}, {"shape", {2, 3}}, {"slices", {{0, 4}, {4, 2}}}};
    if (std::string(kind) == "param/") t["hf"] = {{"a", {3}, 0}, {"b", {3}, 3}};
    tensors.push_back(t);
  }
  return {{"world", 2}, {"tensors", tensors}};
}

Named rank_slices(int rank, float scale) {
  Named out;
  for (const char* kind : {"param/", "exp_avg/", "exp_avg_sq/"}) {
    std::vector<float> v;
    for (int i = rank == 0 ? 0 : 4; i < (rank == 0 ? 4 : 6); ++i) v.push_back(scale * float(i + 1));
    out.emplace_back(std::string(kind) + "w", Tensor::from_vector(v, {int64_t(v.size())}));
    scale *= 10;
  }
  return out;
}

std::string save_two_rank(const std::string& dir, int64_t step, const json& layout) {
  prepare_sharded_checkpoint(dir, step);
  write_checkpoint_shard(dir, step, 0, 2, rank_slices(0, 1.0f));
  write_checkpoint_shard(dir, step, 1, 2, rank_slices(1, 1.0f));
  CheckpointData data;
  data.step = step;
  data.state = {{"step", step}};
  data.config_toml = "[train]\n";
  return complete_sharded_checkpoint(dir, data, layout, 0);
}

TEST(ShardedCheckpoint, EachRankWritesItsFileAndLoadAssemblesTheWhole) {
  ScopedDir dir("sharded_checkpoint");
  const std::string path = save_two_rank(dir.path, 3, two_rank_layout());
  EXPECT_EQ(entries_of(path),
            (std::vector<std::string>{"config.toml", "manifest.json", "shard-00000-of-00002.safetensors",
                                      "shard-00001-of-00002.safetensors", "shards.json", "state.json"}));
  EXPECT_EQ(find_latest_checkpoint(dir.path), path);
  EXPECT_TRUE(is_sharded_checkpoint(path));
  EXPECT_EQ(sharded_checkpoint_world(path), 2);
  const CheckpointData data = load_checkpoint(path);
  ASSERT_EQ(data.model.size(), 2u);  // the HF pieces of "w"
  EXPECT_EQ(data.model[0].first, "a");
  EXPECT_EQ(data.model[0].second.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(data.model[1].second.to_vector<float>(), (std::vector<float>{4, 5, 6}));
  ASSERT_EQ(data.optimizer.size(), 2u);
  EXPECT_EQ(data.optimizer[0].first, "exp_avg/w");
  EXPECT_EQ(data.optimizer[0].second.to_vector<float>(), (std::vector<float>{10, 20, 30, 40, 50, 60}));
  EXPECT_EQ(data.optimizer[1].second.shape(), (Shape{2, 3}));
  const CheckpointShard one = load_checkpoint_shard(path, 1);
  EXPECT_EQ(one.step, 3);
  ASSERT_EQ(one.tensors.size(), 3u);
  EXPECT_EQ(one.tensors[0].second.to_vector<float>(), (std::vector<float>{5, 6}));
}

// Each rank's slices with `dtype(rank, kind)` in place of f32, as optim.state_dtype = bf16 writes the moments.
std::string save_two_rank_in(const std::string& dir, int64_t step,
                             const std::function<DType(int, const std::string&)>& dtype) {
  prepare_sharded_checkpoint(dir, step);
  for (int rank = 0; rank < 2; ++rank) {
    Named slices = rank_slices(rank, 1.0f);
    for (auto& [name, tensor] : slices) tensor = tensor.to(dtype(rank, name.substr(0, name.find('/') + 1)));
    write_checkpoint_shard(dir, step, rank, 2, slices);
  }
  CheckpointData data;
  data.step = step;
  data.state = {{"step", step}};
  data.config_toml = "[train]\n";
  return complete_sharded_checkpoint(dir, data, two_rank_layout(), 0);
}

// Moments in bf16 assemble in bf16; masters stay f32, and a tensor's slices share one dtype, f32 or bf16.
TEST(ShardedCheckpoint, MomentsInBf16AssembleAndOtherDtypesAreRefusedNamingTheFile) {
  ScopedDir dir("sharded_checkpoint_bf16_moments");
  const auto moments_bf16 = [](int, const std::string& kind) { return kind == "param/" ? DType::F32 : DType::BF16; };
  const CheckpointData data = load_checkpoint(save_two_rank_in(dir.path, 1, moments_bf16));
  ASSERT_EQ(data.optimizer.size(), 2u);
  EXPECT_EQ(data.optimizer[0].second.dtype(), DType::BF16);
  EXPECT_EQ(data.optimizer[0].second.to(DType::F32).to_vector<float>(), (std::vector<float>{10, 20, 30, 40, 50, 60}));
  EXPECT_EQ(data.model[0].second.dtype(), DType::F32);

  const auto mixed = [](int rank, const std::string& kind) {
    return kind == "exp_avg/" && rank == 0 ? DType::BF16 : DType::F32;
  };
  const std::string mixed_path = save_two_rank_in(dir.path, 2, mixed);
  expect_error([&] { load_checkpoint(mixed_path); },
               {"shard-00001-of-00002.safetensors", "should hold bf16[2] 'exp_avg/w'", "f32[2]"});
  const auto param_bf16 = [](int, const std::string& kind) { return kind == "param/" ? DType::BF16 : DType::F32; };
  const std::string param_path = save_two_rank_in(dir.path, 3, param_bf16);
  expect_error([&] { load_checkpoint(param_path); },
               {"shard-00000-of-00002.safetensors", "should hold f32[4] 'param/w'", "bf16[4]"});
  const auto moments_f16 = [](int, const std::string& kind) { return kind == "param/" ? DType::F32 : DType::F16; };
  const std::string f16_path = save_two_rank_in(dir.path, 4, moments_f16);
  expect_error([&] { load_checkpoint(f16_path); }, {"shard-00000-of-00002.safetensors", "should hold f32 or bf16[4]"});
}

TEST(ShardedCheckpoint, RefusesLayoutsWhoseSlicesDoNotTileEveryTensor) {
  ScopedDir dir("sharded_checkpoint_layout");
  json gap = two_rank_layout();
  gap["tensors"][1]["slices"] = {{0, 3}, {4, 2}};
  expect_error([&] { save_two_rank(dir.path, 1, gap); }, {"shards.json", "exp_avg/w", "gap or overlap"});
  json outside = two_rank_layout();
  outside["tensors"][0]["slices"] = {{0, 4}, {4, 3}};
  expect_error([&] { save_two_rank(dir.path, 1, outside); }, {"param/w", "outside its 6 elements"});
  json world = two_rank_layout();
  world["world"] = 3;
  expect_error([&] { save_two_rank(dir.path, 1, world); }, {"2 slices for a world of 3"});
  EXPECT_FALSE(find_latest_checkpoint(dir.path)) << "a refused layout publishes nothing";
}

// Issue 20: shards.json values whose products or sums wrap int64 are refused by name, before any allocation.
TEST(ShardedCheckpoint, RefusesLayoutsWhoseArithmeticWouldOverflow) {
  ScopedDir dir("sharded_checkpoint_overflow");
  json huge = two_rank_layout();
  huge["tensors"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  expect_error([&] { save_two_rank(dir.path, 1, huge); }, {"shards.json", "param/w", "more elements"});
  json wrap = two_rank_layout();
  wrap["tensors"][1]["slices"] = {{0, 4}, {int64_t{1} << 62, int64_t{1} << 62}};
  expect_error([&] { save_two_rank(dir.path, 1, wrap); }, {"exp_avg/w", "outside its 6 elements"});
  json wide = two_rank_layout();
  wide["world"] = int64_t{1} << 31;
  expect_error([&] { save_two_rank(dir.path, 1, wide); }, {"shards.json", "world is 2147483648"});
  EXPECT_FALSE(find_latest_checkpoint(dir.path)) << "a refused layout publishes nothing";
}

TEST(Checkpoint, LoadLatestSkipsACorruptCheckpointForThePreviousGoodOne) {
  ScopedDir dir("ckpt_load_latest");
  save_checkpoint(dir.path, make_data(1), 0);
  const std::string newest = save_checkpoint(dir.path, make_data(2), 0);
  std::string bytes = read_file(newest + "/optimizer.safetensors");
  bytes[bytes.size() - 2] ^= 0x01;  // same size: only the hash tells
  write_file(newest + "/optimizer.safetensors", bytes);
  ::testing::internal::CaptureStderr();
  const auto loaded = load_latest_checkpoint(dir.path);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->first, step_path(dir.path, 1));
  EXPECT_EQ(loaded->second.step, 1);
  EXPECT_NE(log.find("skipping " + newest), std::string::npos) << log;
  EXPECT_NE(log.find("optimizer.safetensors"), std::string::npos) << log;
  fs::remove_all(step_path(dir.path, 1));
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(load_latest_checkpoint(dir.path)) << "no checkpoint verifies";
  ::testing::internal::GetCapturedStderr();
}

TEST(ShardedCheckpoint, MissingOrCorruptShardFilesAreCaughtNamingTheFile) {
  ScopedDir dir("sharded_checkpoint_corrupt");
  const std::string path = save_two_rank(dir.path, 2, two_rank_layout());
  const std::string file = (fs::path(path) / "shard-00001-of-00002.safetensors").string();
  std::string bytes = read_file(file);
  bytes[bytes.size() - 1] ^= 0x40;  // same size, one value changed
  write_file(file, bytes);
  expect_error([&] { load_checkpoint(path); }, {"shard-00001-of-00002.safetensors", "corrupt"});
  expect_error([&] { load_checkpoint_shard(path, 1); }, {"shard-00001-of-00002.safetensors", "corrupt"});
  EXPECT_NO_THROW(load_checkpoint_shard(path, 0)) << "rank 0's own file is intact";
  expect_error([&] { load_checkpoint_shard(path, 2); }, {"rank 2", "2 ranks"});
  fs::remove(file);
  std::string log;
  EXPECT_FALSE(find_latest_logging(dir.path, &log));
  EXPECT_NE(log.find("shard-00001-of-00002.safetensors is missing"), std::string::npos) << log;
}

TEST(ShardedCheckpoint, ShardsWithoutAPreparedFolderOrRanksOutsideTheWorldAreRefused) {
  ScopedDir dir("sharded_checkpoint_protocol");
  expect_error([&] { write_checkpoint_shard(dir.path, 5, 0, 2, rank_slices(0, 1.0f)); }, {"rank 0 prepares it"});
  prepare_sharded_checkpoint(dir.path, 5);
  expect_error([&] { write_checkpoint_shard(dir.path, 5, 2, 2, rank_slices(0, 1.0f)); }, {"rank 2", "world of 2"});
  write_checkpoint_shard(dir.path, 5, 0, 2, rank_slices(0, 1.0f));
  CheckpointData data;
  data.step = 5;
  data.state = {{"step", 5}};
  expect_error([&] { complete_sharded_checkpoint(dir.path, data, two_rank_layout(), 0); },
               {"shard-00001-of-00002.safetensors", "rank 1"});
  EXPECT_FALSE(find_latest_checkpoint(dir.path));
}

// Issue 20: the HF pieces of shards.json are checked with the rest of the layout (saving and loading), before any
// tensor is assembled from them.
TEST(ShardedCheckpoint, RefusesHfPiecesOutsideTheirParameter) {
  ScopedDir dir("sharded_checkpoint_pieces");
  json outside = two_rank_layout();
  outside["tensors"][0]["hf"][1] = {"b", {3}, 4};  // elements 4..6 of a 6-element parameter
  expect_error([&] { save_two_rank(dir.path, 1, outside); }, {"shards.json", "of 'param/w' lies outside its 6"});
  json none = two_rank_layout();
  none["tensors"][0].erase("hf");
  expect_error([&] { save_two_rank(dir.path, 1, none); }, {"shards.json", "'param/w' has no HF pieces"});
  EXPECT_FALSE(find_latest_checkpoint(dir.path)) << "a refused layout publishes nothing";
}

// Issue 20: a shards.json rewritten with its manifest entry (so its hash matches) announcing a huge tensor is refused
// by the shard files' sizes before the tensor is allocated (not 256 GiB of zeros first).
TEST(ShardedCheckpoint, AHugeShapeIsRefusedByTheShardFilesBeforeAllocation) {
  ScopedDir dir("sharded_checkpoint_huge");
  const std::string path = save_two_rank(dir.path, 2, two_rank_layout());
  json layout = json::parse(read_file(path + "/shards.json"));
  const int64_t half = int64_t{1} << 35;
  layout["tensors"][1]["shape"] = {2 * half};
  layout["tensors"][1]["slices"] = {{0, half}, {half, half}};
  const std::string text = layout.dump(1) + "\n";
  write_file(path + "/shards.json", text);
  json manifest = json::parse(read_file(path + "/manifest.json"));
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(fnv1a64(text.data(), text.size())));
  manifest["files"]["shards.json"] = {{"bytes", text.size()}, {"fnv1a64", hash}};
  write_file(path + "/manifest.json", manifest.dump(2));
  expect_error([&] { load_checkpoint(path); },
               {"shard-00000-of-00002.safetensors", "should hold f32[34359738368] 'exp_avg/w'", "f32[4]"});
}

// The checks of the text files, on their text (what the fuzz targets run): a real checkpoint's files pass.
TEST(CheckpointText, ParsesTheFilesASaveWrites) {
  ScopedDir dir("ckpt_text");
  const std::string path = save_two_rank(dir.path, 4, two_rank_layout());
  const CheckpointManifest manifest = parse_checkpoint_manifest(read_file(path + "/manifest.json"), path);
  EXPECT_EQ(manifest.step, 4);
  ASSERT_EQ(manifest.files.count("shards.json"), 1u);
  EXPECT_EQ(manifest.files.at("shards.json").bytes, fs::file_size(path + "/shards.json"));
  EXPECT_EQ(parse_shard_layout(read_file(path + "/shards.json"), path)["world"], 2);
  const json state = parse_checkpoint_state(R"({"step": 4, "optimizer_steps": 3, "data": null})", path);
  EXPECT_EQ(state["optimizer_steps"], 3);
}

TEST(CheckpointText, RefusesBadManifests) {
  expect_error([&] { parse_checkpoint_manifest("[1, 2]", "ckpt/step_00000001"); },
               {"checkpoint ckpt/step_00000001", "manifest.json is a JSON array, expected an object"});
  expect_error([&] { parse_checkpoint_manifest(R"({"format": "moetrain-checkpoint", "version": 1})", "c"); },
               {"\"step\" is missing"});
  expect_error([&] { parse_checkpoint_manifest(std::string(size_t{1} << 21, ' '), "c"); },
               {"manifest.json has 2097152 bytes, more than the limit of 1048576"});
}

TEST(CheckpointText, RefusesBadStates) {
  expect_error([&] { parse_checkpoint_state("{\"step\": 1", "c"); }, {"checkpoint c: state.json is not JSON"});
  expect_error([&] { parse_checkpoint_state(R"({"step": 1, "data": null})", "c"); },
               {"state.json lacks step, optimizer_steps or data"});
  expect_error([&] { parse_checkpoint_state(R"({"step": -1, "optimizer_steps": 0, "data": null})", "c"); },
               {"field 'step' is -1, expected a non-negative integer"});
  expect_error(
      [&] { parse_checkpoint_state(R"({"step": 18446744073709551615, "optimizer_steps": 0, "data": 0})", "c"); },
      {"field 'step' is 18446744073709551615"});
  expect_error([&] { parse_checkpoint_state(R"({"step": 2, "optimizer_steps": 3, "data": null})", "c"); },
               {"optimizer_steps 3 after step 2"});
  expect_error([&] { parse_checkpoint_state(R"({"step": 2, "optimizer_steps": 2, "data": null})", "d/step_00000003"); },
               {"state.json says step 2, the folder name says step 3"});
}

TEST(CheckpointText, RefusesBadShardLayouts) {
  expect_error([&] { parse_shard_layout("{}", "c"); }, {"checkpoint c: shards.json", "\"world\": N >= 1"});
  json layout = two_rank_layout();
  layout["tensors"][0]["hf"][0] = {"a", {3}, 4};
  expect_error([&] { parse_shard_layout(layout.dump(), "c"); }, {"of 'param/w' lies outside its 6 elements"});
  layout["tensors"][0]["hf"][0] = {"a", {3}, -1};
  expect_error([&] { parse_shard_layout(layout.dump(), "c"); }, {"HF piece 'a' has the offset -1"});
}

}  // namespace
}  // namespace moetrain::train
