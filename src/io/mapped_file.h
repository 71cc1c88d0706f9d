// defines: MappedFile, a read-only memory map of a whole file. Tensors read from safetensors files
// are views into one of these and hold it alive through their storage owner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace moetrain::io {

class MappedFile {
 public:
  // Maps `path` read-only (PROT_READ, MAP_PRIVATE). A zero-length file maps nothing: data() is
  // nullptr and size() is 0. Errors name the path and the system's reason.
  static std::shared_ptr<MappedFile> open(const std::string& path);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  // The mapped bytes are read-only: writing through a pointer into them faults.
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size);

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moetrain::io
