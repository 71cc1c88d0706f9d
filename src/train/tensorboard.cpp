// defines: CRC32C, the TFRecord framing, the Event protobuf encoders and the event-file writer.
#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::train {

namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

// Protobuf wire format: varints, tags (field << 3 | wire type), fixed 64/32-bit little-endian values.
void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}
void put_tag(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}
void put_double(std::string& out, int field, double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  put_tag(out, field, 1);
  put_le(out, bits, 8);
}
void put_float(std::string& out, int field, float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  put_tag(out, field, 5);
  put_le(out, bits, 4);
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}
void put_int64(std::string& out, int field, int64_t value) {
  put_tag(out, field, 0);
  put_varint(out, static_cast<uint64_t>(value));  // int64: negative values as their two's complement (10 bytes)
}

std::string event_header(double wall_time, int64_t step) {
  std::string event;
  put_double(event, 1, wall_time);
  put_int64(event, 2, step);
  return event;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "localhost";
  std::string host(name.data());
  for (char& c : host) {
    if (c == '/') c = '_';  // a file name component
  }
  return host;
}

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  crc = ~crc;
  for (const char c : data) crc = kCrc32cTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string length;
  put_le(length, data.size(), 8);
  std::string out = length;
  put_le(out, masked_crc32c(length), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

std::string event_file_version(double wall_time, std::string_view version) {
  std::string event = event_header(wall_time, 0);
  put_bytes(event, 3, version);
  return event;
}

std::string event_scalars(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  std::string event = event_header(wall_time, step);
  put_bytes(event, 5, summary);
  return event;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : file_(nullptr, &std::fclose) {
  namespace fs = std::filesystem;
  std::error_code ec;
  MT_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
           "metrics.tensorboard: '{}' exists and is not a folder (expected a folder for the event files)", dir);
  fs::create_directories(dir, ec);
  MT_CHECK(!ec, "metrics.tensorboard: cannot create the folder '{}': {}", dir, ec.message());
  const double now = unix_seconds();
  path_ = (fs::path(dir) / fmt::format("events.out.tfevents.{}.{}.{}.moetrain", static_cast<int64_t>(now), host_name(),
                                       static_cast<int64_t>(getpid())))
              .string();
  file_.reset(std::fopen(path_.c_str(), "ab"));
  MT_CHECK(file_ != nullptr, "metrics.tensorboard: cannot open '{}' for writing: {}", path_, std::strerror(errno));
  write_record(event_file_version(now));
}

void TensorBoardWriter::add_scalars(int64_t step, const Scalars& scalars) {
  write_record(event_scalars(unix_seconds(), step, scalars));
}

void TensorBoardWriter::write_record(const std::string& event) {
  const std::string record = tfrecord(event);
  MT_CHECK(std::fwrite(record.data(), 1, record.size(), file_.get()) == record.size() && std::fflush(file_.get()) == 0,
           "metrics.tensorboard: writing '{}' failed: {}", path_, std::strerror(errno));
}

}  // namespace moetrain::train
