// defines: TensorBoardWriter, TensorBoard event files written with no dependency (no Python, no protobuf library):
// the TFRecord framing (uint64 length, masked CRC32C of the length, the data, masked CRC32C of the data) around
// hand-encoded `Event` protobufs (wall_time, step, file_version in the first record, a Summary of simple scalar
// values); and the CRC32C and encoders it is built from, for tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moetrain::train {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`, continuing from `crc` (0 to start):
// crc32c("123456789") = 0xE3069283.
uint32_t crc32c(std::string_view data, uint32_t crc = 0);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(std::string_view data);
// One TFRecord: uint64 length (little-endian), masked CRC32C of those 8 bytes, `data`, masked CRC32C of `data`.
std::string tfrecord(std::string_view data);

using Scalars = std::vector<std::pair<std::string, double>>;  // (tag, value)
// A serialized tensorboard `Event`: wall_time (double, field 1), step (int64, field 2), then either file_version
// (string, field 3) or summary (field 5): Summary { repeated Value value = 1 { string tag = 1; float simple_value =
// 2; } }.
std::string event_file_version(double wall_time, std::string_view version = "brain.Event:2");
std::string event_scalars(double wall_time, int64_t step, const Scalars& scalars);

class TensorBoardWriter {
 public:
  // Creates `dir` (refused when it exists and is not a folder) and a new event file in it,
  // events.out.tfevents.<unix seconds>.<hostname>.<pid>.moetrain, whose first record is the file version.
  explicit TensorBoardWriter(const std::string& dir);
  // One Event of every scalar at `step`, flushed to the file (a crash loses at most the step in flight).
  void add_scalars(int64_t step, const Scalars& scalars);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_;
};

}  // namespace moetrain::train
