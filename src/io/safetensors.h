// defines: reading and writing of the safetensors format (a u64 header length, a JSON header, then
// the tensor bytes) for one file and for a sharded set behind a model.safetensors.index.json.
// Reading maps the file and hands out views into the mapping; every header is validated on open
// (dtypes, shapes, offsets, overlaps, holes, duplicate names), so a bad file fails before use.
// Writing is atomic: a crash never leaves a half-written file under the real name.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"

namespace moetrain::io {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

// A parsed and validated header: the tensors by name and the __metadata__ strings.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses the JSON header of a file whose data section has `data_size` bytes; `path` names the file in errors. Every
// check of SafetensorsFile::open runs here (a NUL byte, duplicate keys, dtypes, shapes, offsets, overlaps, holes),
// in time linear in the header's size (a million tensors parse in about a second).
SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t data_size, const std::string& path);

// Parses a sharded set's index (model.safetensors.index.json: {"weight_map": {tensor: shard file}, "metadata": ...})
// found at `path`: the weight_map must be a non-empty object of non-empty relative file names without '..' (shards
// live in the model folder; an absolute path or a '..' would load weights from anywhere), and the JSON must not
// repeat a key. Returns tensor name -> shard path (the file name joined to `path`'s folder). Reads no file: that a
// shard exists and holds what the index says is checked by SafetensorsReader::open.
std::map<std::string, std::string> parse_safetensors_index(std::string_view text, const std::string& path);

// One .safetensors file, mapped and validated.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted by name
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // error naming file + tensor if absent
  // A CPU tensor: a zero-copy view into the mapping (kept alive by the tensor) when the data start
  // is aligned to the dtype size, else an aligned copy. Views are read-only memory: clone() a
  // tensor before writing to it.
  Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::shared_ptr<MappedFile>& mapping() const { return file_; }

 private:
  std::string path_;
  std::shared_ptr<MappedFile> file_;
  uint64_t data_start_ = 0;  // byte offset of the data section in the file
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A model's weights: one file or a sharded set.
class SafetensorsReader {
 public:
  // path: a .safetensors file, a *.safetensors.index.json, or a folder holding model.safetensors
  // or model.safetensors.index.json (a folder holding both is an error: one of them is stale).
  static SafetensorsReader open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return file_of_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  Tensor tensor(const std::string& name) const;
  std::string file_of(const std::string& name) const;  // path of the shard holding `name`

 private:
  const SafetensorsFile& file_for(const std::string& name) const;

  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> file_of_;  // tensor name -> index into files_
};

// Writes atomically (io/atomic_file.h): to a new "<path>.tmp-<pid>-<n>" created exclusively (never through a
// symlink), then fsync and rename (and fsync of the folder). Tensors must
// be contiguous CPU tensors with unique, non-empty names; they are laid out back to back in the
// given order, as Hugging Face does, after a header padded with spaces to a multiple of 8 bytes.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes <dir>/<stem>-0000i-of-0000n.safetensors shards of at most max_shard_bytes of tensor data
// each (a tensor bigger than that gets a shard alone), filled in the given order, plus
// <dir>/<stem>.safetensors.index.json {"metadata": {"total_size": N}, "weight_map": {name: file}},
// written last. With a single shard it writes just <dir>/<stem>.safetensors. Every shard carries
// `metadata`. Creates `dir` if needed. Returns the paths written (shards, then the index).
std::vector<std::string> write_safetensors_sharded(const std::string& dir, const std::string& stem,
                                                   const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                   uint64_t max_shard_bytes,
                                                   const std::map<std::string, std::string>& metadata = {});

}  // namespace moetrain::io
