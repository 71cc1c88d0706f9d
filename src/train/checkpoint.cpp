// defines: checkpoint saving (temporary folder, fsync, atomic rename or exchange, rotation),
// discovery of the newest complete checkpoint, and fully verified loading.
#include "train/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>
#include <tuple>

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include "core/error.h"
#include "core/log.h"
#include "io/json_fields.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"
#include "model/hf_adapter.h"

namespace moetrain::train {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

constexpr const char* kFormat = "moetrain-checkpoint";
constexpr int64_t kVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kConfigFile = "config.toml";
constexpr const char* kRequiredFiles[] = {kModelFile, kOptimizerFile, kStateFile, kConfigFile};
constexpr const char* kShardLayout = "shards.json";
constexpr const char* kShardedTmpMarker = ".tmp-sharded";
// Bounds on shards.json before anything is allocated from it: far above any mesh, and an f32 tensor of 2^60 elements
// is past any device (shape_nbytes refuses it as well).
constexpr int64_t kMaxShardWorld = int64_t{1} << 20;
constexpr int64_t kMaxShardedElements = int64_t{1} << 60;

std::string shard_file_name(int rank, int world) {
  return fmt::format("shard-{:05d}-of-{:05d}.safetensors", rank, world);
}
// A manifest lists a handful of files; anything much bigger is not one of ours.
constexpr uintmax_t kMaxManifestBytes = 1 << 20;
constexpr const char* kStepPrefix = "step_";
constexpr const char* kTmpMarker = ".tmp-";

std::string errno_text(int error) { return std::system_category().message(error); }

std::string step_folder_name(int64_t step) { return fmt::format("{}{:08d}", kStepPrefix, step); }

// The step of a folder named step_<at least 8 digits, as step_folder_name writes them>; empty otherwise.
std::optional<int64_t> parse_step_folder(const std::string& name) {
  const std::string prefix = kStepPrefix;
  if (name.size() < prefix.size() + 8 || name.size() > prefix.size() + 18) return std::nullopt;
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string digits = name.substr(prefix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  if (step_folder_name(step) != name) return std::nullopt;  // e.g. step_000000001: not canonical
  return step;
}

// A folder a save left behind: step_<digits>.tmp-<anything>.
bool is_temporary_folder_name(const std::string& name) {
  const size_t marker = name.find(kTmpMarker);
  if (marker == std::string::npos || name.compare(0, 5, kStepPrefix) != 0 || marker <= 5) return false;
  return std::all_of(name.begin() + 5, name.begin() + static_cast<std::ptrdiff_t>(marker),
                     [](char c) { return c >= '0' && c <= '9'; });
}

std::string hash_hex(uint64_t hash) { return fmt::format("{:016x}", hash); }

std::optional<uint64_t> parse_hash_hex(const std::string& text) {
  if (text.size() != 16) return std::nullopt;
  if (!std::all_of(text.begin(), text.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
    return std::nullopt;
  }
  uint64_t value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value, 16);
  return value;
}

uint64_t hash_file(const std::string& path) {
  const auto mapping = io::MappedFile::open(path);
  return fnv1a64(mapping->data(), mapping->size());
}

// ---- writing ----

void write_all(int fd, const std::string& text, const std::string& path) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t written = ::write(fd, p, left);
    if (written < 0 && errno == EINTR) continue;
    MT_CHECK(written > 0, "checkpoint: cannot write {} ({} bytes left): {}", path, left,
             written < 0 ? errno_text(errno) : std::string("write wrote nothing"));
    p += written;
    left -= static_cast<size_t>(written);
  }
}

// Creates `path` (which must not exist), writes `text` and fsyncs it.
void write_new_file_synced(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, "checkpoint: cannot create {}: {}", path, errno_text(errno));
  try {
    write_all(fd, text, path);
    MT_CHECK(::fsync(fd) == 0, "checkpoint: cannot sync {}: {}", path, errno_text(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  MT_CHECK(::close(fd) == 0, "checkpoint: cannot close {}: {}", path, errno_text(errno));
}

void fsync_folder(const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "checkpoint: cannot open folder {} to sync it: {}", folder, errno_text(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  MT_CHECK(rc == 0, "checkpoint: cannot sync folder {}: {}", folder, errno_text(error));
}

void validate_tensors(const NamedTensors& tensors, const char* group) {
  std::set<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    MT_CHECK(!name.empty(), "checkpoint: a {} tensor has an empty name, expected a non-empty unique name", group);
    MT_CHECK(names.insert(name).second, "checkpoint: {} tensor name '{}' appears twice, expected unique names", group,
             name);
    MT_CHECK(tensor.defined(), "checkpoint: {} tensor '{}' is undefined, expected a contiguous CPU tensor", group,
             name);
    MT_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
             "checkpoint: {} tensor '{}' is {}{}, expected a contiguous CPU tensor (copy it to the CPU first)", group,
             name, tensor.describe(), tensor.is_contiguous() ? "" : " (not contiguous)");
  }
}

// Removes a folder; a failure is a warning (what is left is cleaned up by a later save).
void remove_folder_or_warn(const std::string& path, const char* what) {
  std::error_code error;
  fs::remove_all(path, error);
  if (error) log_warn("checkpoint: cannot remove {} {}: {}", what, path, error.message());
}

// Deletes the oldest complete checkpoints beyond `keep` (never `just_written`), then every
// step_*.tmp-* folder. A checkpoint is renamed to a temporary name before its files go, so a crash
// halfway through a deletion leaves a folder the next save removes, not a broken step_N.
void clean_up(const std::string& dir, int64_t just_written, int64_t keep) {
  if (keep > 0) {
    std::vector<int64_t> others;
    for (int64_t step : list_checkpoints(dir)) {
      if (step != just_written) others.push_back(step);
    }
    const size_t allowed = static_cast<size_t>(keep - 1);
    for (size_t i = 0; i + allowed < others.size(); ++i) {
      const fs::path old_path = fs::path(dir) / step_folder_name(others[i]);
      const fs::path doomed =
          fs::path(dir) / fmt::format("{}{}{}-delete", step_folder_name(others[i]), kTmpMarker, ::getpid());
      std::error_code error;
      fs::rename(old_path, doomed, error);
      if (error) {
        log_warn("checkpoint: cannot remove old checkpoint {} (keep = {}): {}", old_path.string(), keep,
                 error.message());
      }
    }
  }
  std::error_code error;
  std::vector<std::string> temporary;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    if (is_temporary_folder_name(it->path().filename().string())) temporary.push_back(it->path().string());
  }
  if (error) log_warn("checkpoint: cannot list {} to remove temporary folders: {}", dir, error.message());
  for (const std::string& path : temporary) remove_folder_or_warn(path, "temporary folder");
}

// Moves the complete folder `tmp` to `final_path`. When `final_path` exists it is exchanged
// atomically with `tmp` (which then holds the old checkpoint, deleted by clean_up).
void publish(const std::string& tmp, const std::string& final_path) {
  std::error_code error;
  const bool exists = fs::exists(fs::symlink_status(final_path, error));
  if (!exists) {
    MT_CHECK(::rename(tmp.c_str(), final_path.c_str()) == 0, "checkpoint: cannot rename {} to {}: {}", tmp, final_path,
             errno_text(errno));
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) return;
  const int exchange_error = errno;
  MT_CHECK(exchange_error == EINVAL || exchange_error == ENOSYS || exchange_error == ENOTSUP,
           "checkpoint: cannot exchange {} with the existing {}: {}", tmp, final_path, errno_text(exchange_error));
  // The file system cannot exchange: move the old one aside first. A crash between the two renames
  // loses step N (both copies sit in temporary folders), never an earlier checkpoint.
  const std::string aside = fmt::format("{}{}{}-old", final_path, kTmpMarker, ::getpid());
  MT_CHECK(::rename(final_path.c_str(), aside.c_str()) == 0, "checkpoint: cannot move the existing {} aside to {}: {}",
           final_path, aside, errno_text(errno));
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    const int rename_error = errno;
    ::rename(aside.c_str(), final_path.c_str());  // put the old one back; the caller removes tmp
    MT_FAIL("checkpoint: cannot rename {} to {}: {}", tmp, final_path, errno_text(rename_error));
  }
}

// Runs `write` (which fills the temporary folder `tmp`); on any failure removes `tmp` and rethrows, a file-system
// error as one naming the folder.
void write_in_temporary(const std::string& tmp, const std::function<void()>& write) {
  std::error_code error;
  try {
    write();
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, error);
    MT_FAIL("checkpoint: cannot write {}: {}", tmp, e.what());
  } catch (...) {
    fs::remove_all(tmp, error);
    throw;
  }
}

// Lists `files` of `tmp` with their sizes and hashes in a manifest written last, then publishes `tmp` as
// `final_path`; on any failure `tmp` is removed and the error names it.
void seal_and_publish(const std::string& tmp, const std::string& final_path, int64_t step,
                      const std::vector<std::string>& files) {
  write_in_temporary(tmp, [&] {
    nlohmann::ordered_json listed = nlohmann::ordered_json::object();
    for (const std::string& file : files) {
      const std::string path = (fs::path(tmp) / file).string();
      listed[file] = {{"bytes", fs::file_size(path)}, {"fnv1a64", hash_hex(hash_file(path))}};
    }
    nlohmann::ordered_json manifest = nlohmann::ordered_json::object();
    manifest["format"] = kFormat;
    manifest["version"] = kVersion;
    manifest["step"] = step;
    manifest["files"] = std::move(listed);
    write_new_file_synced((fs::path(tmp) / kManifest).string(), manifest.dump(2) + "\n");
    fsync_folder(tmp);
    publish(tmp, final_path);
  });
}

// After a publish: the folder entry made durable, then old and temporary checkpoints removed (a failure there is
// only a warning: the new checkpoint is safe).
std::string finish_save(const std::string& dir, const std::string& final_path, int64_t step, int64_t keep) {
  fsync_folder(dir);
  try {
    clean_up(dir, step, keep);
  } catch (const Error& e) {
    log_warn("checkpoint: saved {} but could not clean up {}: {}", final_path, dir, e.what());
  }
  return final_path;
}

// ---- reading ----

using Manifest = CheckpointManifest;

// Checks the text of a manifest.json. On failure returns empty and sets `problem` to a reason that names the file.
std::optional<Manifest> manifest_from_text(std::string_view text, std::string* problem) {
  if (text.size() > kMaxManifestBytes) {
    *problem = fmt::format("{} has {} bytes, more than the limit of {}", kManifest, text.size(), kMaxManifestBytes);
    return std::nullopt;
  }
  json manifest;
  try {
    manifest = json::parse(text);
  } catch (const json::exception& e) {
    *problem = fmt::format("{} is not JSON: {}", kManifest, e.what());
    return std::nullopt;
  }
  if (!manifest.is_object()) {
    *problem = fmt::format("{} is a JSON {}, expected an object", kManifest, manifest.type_name());
    return std::nullopt;
  }
  const auto format = manifest.find("format");
  if (format == manifest.end() || !format->is_string() || format->get<std::string>() != kFormat) {
    *problem = fmt::format("{}: \"format\" is {}, expected \"{}\"", kManifest,
                           format == manifest.end() ? "missing" : format->dump(), kFormat);
    return std::nullopt;
  }
  const auto version = manifest.find("version");
  if (version == manifest.end() || !version->is_number_integer() || version->get<int64_t>() != kVersion) {
    *problem = fmt::format("{}: \"version\" is {}, expected {} (the version this build reads)", kManifest,
                           version == manifest.end() ? "missing" : version->dump(), kVersion);
    return std::nullopt;
  }
  const auto step = manifest.find("step");
  if (step == manifest.end() || !step->is_number_integer() || step->get<int64_t>() < 0) {
    *problem = fmt::format("{}: \"step\" is {}, expected a non-negative integer", kManifest,
                           step == manifest.end() ? "missing" : step->dump());
    return std::nullopt;
  }
  const auto files = manifest.find("files");
  if (files == manifest.end() || !files->is_object()) {
    *problem = fmt::format("{}: \"files\" is {}, expected an object", kManifest,
                           files == manifest.end() ? "missing" : files->type_name());
    return std::nullopt;
  }
  Manifest result;
  result.step = step->get<int64_t>();
  for (const auto& [name, entry] : files->items()) {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      *problem = fmt::format("{} lists the file name '{}', expected a plain file name", kManifest, name);
      return std::nullopt;
    }
    const auto bytes = entry.is_object() ? entry.find("bytes") : entry.end();
    const auto hash = entry.is_object() ? entry.find("fnv1a64") : entry.end();
    const std::optional<uint64_t> hash_value =
        hash != entry.end() && hash->is_string() ? parse_hash_hex(hash->get<std::string>()) : std::nullopt;
    if (bytes == entry.end() || !bytes->is_number_unsigned() || !hash_value) {
      *problem =
          fmt::format("{}: the entry of {} is {}, expected {{\"bytes\": size, \"fnv1a64\": 16 lowercase hex digits}}",
                      kManifest, name, entry.dump());
      return std::nullopt;
    }
    result.files[name] = {bytes->get<uint64_t>(), *hash_value};
  }
  // A replicated checkpoint has the model and optimizer files; a sharded one, shards.json and its shard files (which
  // load_checkpoint checks against shards.json).
  const bool sharded = result.files.count(kShardLayout) != 0;
  for (const char* name : kRequiredFiles) {
    const bool tensors = std::string(name) == kModelFile || std::string(name) == kOptimizerFile;
    if (!(sharded && tensors) && !result.files.count(name)) {
      *problem = fmt::format("{} does not list {}", kManifest, name);
      return std::nullopt;
    }
  }
  return result;
}

// Reads and checks <folder>/manifest.json. On failure returns empty and sets `problem` to a reason
// that names the file.
std::optional<Manifest> read_manifest(const std::string& folder, std::string* problem) {
  const std::string path = (fs::path(folder) / kManifest).string();
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    *problem = fmt::format("{} is missing (the checkpoint was not completed)", kManifest);
    return std::nullopt;
  }
  const uintmax_t size = fs::file_size(path, error);
  if (error || size > kMaxManifestBytes) {
    *problem = error ? fmt::format("cannot read the size of {}: {}", kManifest, error.message())
                     : fmt::format("{} has {} bytes, more than the limit of {}", kManifest, size, kMaxManifestBytes);
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) {
    *problem = fmt::format("cannot read {}", kManifest);
    return std::nullopt;
  }
  return manifest_from_text(text, problem);
}

// Checks that every listed file exists with its listed size; empty when they all do.
std::string size_problem(const std::string& folder, const Manifest& manifest) {
  for (const auto& [name, entry] : manifest.files) {
    const fs::path path = fs::path(folder) / name;
    std::error_code error;
    if (!fs::is_regular_file(path, error)) return fmt::format("{} is missing", name);
    const uintmax_t size = fs::file_size(path, error);
    if (error) return fmt::format("cannot read the size of {}: {}", name, error.message());
    if (size != entry.bytes) {
      return fmt::format("{} has {} bytes, the manifest lists {} (truncated or rewritten)", name, size, entry.bytes);
    }
  }
  return {};
}

// Why <dir>/<name> (named for `step`) is not a complete checkpoint; empty when it is.
std::string completeness_problem(const fs::path& folder, int64_t step) {
  std::error_code error;
  if (!fs::is_directory(folder, error)) return "not a folder";
  std::string problem;
  const std::optional<Manifest> manifest = read_manifest(folder.string(), &problem);
  if (!manifest) return problem;
  if (manifest->step != step) {
    return fmt::format("{} says step {}, the folder name says step {}", kManifest, manifest->step, step);
  }
  return size_problem(folder.string(), *manifest);
}

// The step_N folders of dir, by step. Empty when dir does not exist; an error when it is not a folder.
std::map<int64_t, fs::path> step_folders(const std::string& dir) {
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (status.type() == fs::file_type::not_found) return {};
  MT_CHECK(!error, "checkpoint: cannot read checkpoint folder {}: {}", dir, error.message());
  MT_CHECK(fs::is_directory(status), "checkpoint: {} is not a folder, expected the checkpoint folder", dir);
  std::map<int64_t, fs::path> folders;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    if (const auto step = parse_step_folder(it->path().filename().string())) folders[*step] = it->path();
  }
  MT_CHECK(!error, "checkpoint: cannot list checkpoint folder {}: {}", dir, error.message());
  return folders;
}

// The tensors of one safetensors file, cloned, in the order they were written (by data offset).
NamedTensors read_tensors(const std::string& path) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  std::vector<const io::SafetensorsEntry*> entries;
  for (const std::string& name : file.names()) entries.push_back(&file.entry(name));
  std::stable_sort(entries.begin(), entries.end(), [](const io::SafetensorsEntry* a, const io::SafetensorsEntry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  NamedTensors tensors;
  tensors.reserve(entries.size());
  for (const io::SafetensorsEntry* entry : entries) tensors.emplace_back(entry->name, file.tensor(entry->name).clone());
  return tensors;
}

// A checkpoint's text files (state.json, config.toml, shards.json): regular files, checked before they are opened
// (a FIFO would block), and bounded in size.
constexpr int64_t kMaxTextFileBytes = int64_t{256} << 20;

std::string read_text_file(const std::string& folder, const char* name) {
  try {
    return io::read_bounded_file((fs::path(folder) / name).string(), kMaxTextFileBytes);
  } catch (const Error& e) {
    MT_FAIL("checkpoint {}: cannot read {}: {}", folder, name, e.what());
  }
}

json parse_json_text(std::string_view text, const std::string& folder, const char* name) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    MT_FAIL("checkpoint {}: {} is not JSON: {}", folder, name, e.what());
  }
}

json read_json_file(const std::string& folder, const char* name) {
  return parse_json_text(read_text_file(folder, name), folder, name);
}

// The manifest of a folder, fully checked: step against the folder name, sizes, and the hashes of `hashed` files
// (every listed file when empty).
Manifest verified_manifest(const std::string& path, const std::vector<std::string>& hashed) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  MT_CHECK(status.type() != fs::file_type::not_found, "checkpoint: {} does not exist, expected a checkpoint folder",
           path);
  MT_CHECK(fs::is_directory(status), "checkpoint: {} is not a folder, expected a checkpoint folder", path);
  std::string problem;
  const std::optional<Manifest> manifest = read_manifest(path, &problem);
  MT_CHECK(manifest, "checkpoint {}: {}", path, problem);
  const fs::path normal = fs::path(path).lexically_normal();
  const std::string folder_name = (normal.has_filename() ? normal : normal.parent_path()).filename().string();
  if (const auto named_step = parse_step_folder(folder_name)) {
    MT_CHECK(*named_step == manifest->step, "checkpoint {}: {} says step {}, the folder name says step {}", path,
             kManifest, manifest->step, *named_step);
  }
  problem = size_problem(path, *manifest);
  MT_CHECK(problem.empty(), "checkpoint {}: {}", path, problem);
  for (const auto& [name, entry] : manifest->files) {
    if (!hashed.empty() && std::find(hashed.begin(), hashed.end(), name) == hashed.end()) continue;
    const uint64_t hash = hash_file((fs::path(path) / name).string());
    MT_CHECK(hash == entry.hash, "checkpoint {}: {} has FNV-1a 64 hash {}, the manifest lists {} (the file is corrupt)",
             path, name, hash_hex(hash), hash_hex(entry.hash));
  }
  return *manifest;
}

// Checks shards.json's shape: world, and per tensor a name, a shape, one [first, count] slice per rank inside the
// tensor, slices that tile it exactly, and (param/ tensors) HF pieces that tile it.
void check_shard_layout(const json& layout, const std::string& where) {
  const auto fail = [&](const std::string& what) { MT_FAIL("checkpoint {}: {}: {}", where, kShardLayout, what); };
  if (!layout.is_object() || !layout.contains("world") || !layout["world"].is_number_integer() ||
      layout["world"].get<int64_t>() < 1 || !layout.contains("tensors") || !layout["tensors"].is_array())
    fail("expected {\"world\": N >= 1, \"tensors\": [...]}");
  const int64_t world = layout["world"].get<int64_t>();
  if (world > kMaxShardWorld)
    fail(fmt::format("world is {}, more than the {} ranks a checkpoint may have", world, kMaxShardWorld));
  for (const json& t : layout["tensors"]) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("slices") || !t["slices"].is_array())
      fail("a tensor entry lacks name, shape or slices: " + t.dump());
    const std::string name = t["name"].get<std::string>();
    int64_t numel = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(name + ": a bad shape " + t["shape"].dump());
      if (__builtin_mul_overflow(numel, d.get<int64_t>(), &numel) || numel > kMaxShardedElements)
        fail(fmt::format("{}: shape {} has more elements than a tensor may have", name, t["shape"].dump()));
    }
    if (static_cast<int64_t>(t["slices"].size()) != world)
      fail(fmt::format("{}: {} slices for a world of {}", name, t["slices"].size(), world));
    std::vector<std::pair<int64_t, int64_t>> slices;
    for (const json& sl : t["slices"]) {
      if (!sl.is_array() || sl.size() != 2 || !sl[0].is_number_integer() || !sl[1].is_number_integer())
        fail(name + ": a slice is not [first, count]: " + sl.dump());
      const int64_t first = sl[0].get<int64_t>(), count = sl[1].get<int64_t>();
      // count > numel - first, not first + count > numel: the sum of two hostile values can wrap.
      if (first < 0 || count < 0 || first > numel || count > numel - first)
        fail(fmt::format("{}: slice [first {}, count {}] outside its {} elements", name, first, count, numel));
      if (count > 0) slices.emplace_back(first, count);
    }
    std::sort(slices.begin(), slices.end());
    int64_t covered = 0;
    for (const auto& [first, count] : slices) {
      if (first != covered)
        fail(fmt::format("{}: the slices do not tile it (a gap or overlap at element {})", name, covered));
      covered += count;
    }
    if (covered != numel) fail(fmt::format("{}: the slices cover {} of its {} elements", name, covered, numel));
    if (name.rfind("param/", 0) != 0) continue;
    // A parameter's HF pieces, each inside it (assemble_shards cuts them out of the assembled tensor).
    if (!t.contains("hf") || !t["hf"].is_array()) fail(fmt::format("'{}' has no HF pieces", name));
    for (const json& entry : t["hf"]) {
      const model::HfPiece piece = model::piece_from_json(entry, fmt::format("checkpoint {}: {}", where, kShardLayout));
      if (piece.offset < 0 || piece.last_element() >= numel)
        fail(fmt::format("piece {} of '{}' lies outside its {} elements", entry.dump(), name, numel));
    }
  }
}

// The full tensors of a sharded checkpoint from every rank's file: model tensors under their HF names (split by
// the layout's pieces), optimizer tensors under their own names.
void assemble_shards(const std::string& path, const json& layout, CheckpointData& data) {
  const int world = layout["world"].get<int>();
  std::vector<std::map<std::string, Tensor>> shards(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (auto& [name, tensor] : read_tensors((fs::path(path) / shard_file_name(r, world)).string()))
      shards[static_cast<size_t>(r)].emplace(name, std::move(tensor));
  }
  for (const json& t : layout["tensors"]) {
    const std::string name = t["name"].get<std::string>();
    // Every rank's slice is in its file before the tensor is allocated: the files' sizes bound the shape, which a
    // hostile shards.json could otherwise make as large as check_shard_layout allows. Masters are f32; moments are
    // f32 or bf16 (optim.state_dtype), every rank's slice in the dtype of the first.
    const bool is_param = name.rfind("param/", 0) == 0;
    std::optional<DType> dtype;
    if (is_param) dtype = DType::F32;
    for (int r = 0; r < world; ++r) {
      const int64_t count = t["slices"][static_cast<size_t>(r)][1].get<int64_t>();
      if (count == 0) continue;
      const auto it = shards[static_cast<size_t>(r)].find(name);
      const bool found = it != shards[static_cast<size_t>(r)].end();
      if (found && !dtype && (it->second.dtype() == DType::F32 || it->second.dtype() == DType::BF16)) {
        dtype = it->second.dtype();
      }
      MT_CHECK(found && it->second.numel() == count && dtype && it->second.dtype() == *dtype,
               "checkpoint {}: {} should hold {}[{}] '{}' but has {}", path, shard_file_name(r, world),
               dtype ? std::string(dtype_name(*dtype)) : std::string("f32 or bf16"), count, name,
               found ? it->second.describe() : std::string("none"));
    }
    Tensor full = Tensor::zeros(t["shape"].get<Shape>(), dtype.value_or(DType::F32));
    Tensor flat = full.view({-1});
    for (int r = 0; r < world; ++r) {
      const int64_t first = t["slices"][static_cast<size_t>(r)][0].get<int64_t>();
      const int64_t count = t["slices"][static_cast<size_t>(r)][1].get<int64_t>();
      if (count > 0) flat.slice(first, first + count).copy_from(shards[static_cast<size_t>(r)].at(name).view({-1}));
    }
    if (!is_param) {
      data.optimizer.emplace_back(name, full);
      continue;
    }
    for (const json& entry : t["hf"]) {  // checked by check_shard_layout
      const model::HfPiece piece = model::piece_from_json(entry, fmt::format("checkpoint {}: {}", path, kShardLayout));
      data.model.emplace_back(piece.hf_name, model::extract_piece(full, piece));
    }
  }
}

}  // namespace

CheckpointManifest parse_checkpoint_manifest(std::string_view text, const std::string& folder) {
  std::string problem;
  std::optional<Manifest> manifest = manifest_from_text(text, &problem);
  MT_CHECK(manifest, "checkpoint {}: {}", folder, problem);
  return std::move(*manifest);
}

Tensor moment_for_job(const std::map<std::string, Tensor>& moments, const std::string& name, const Shape& shape,
                      DType dtype, const std::string& checkpoint, bool* converted) {
  const auto it = moments.find(name);
  MT_CHECK(it != moments.end(), "checkpoint {}: optimizer state '{}' is missing", checkpoint, name);
  const Tensor& moment = it->second;
  MT_CHECK(moment.shape() == shape && (moment.dtype() == DType::F32 || moment.dtype() == DType::BF16),
           "checkpoint {}: optimizer state '{}' is {} but f32{} or bf16{} was expected", checkpoint, name,
           moment.describe(), shape_str(shape), shape_str(shape));
  if (moment.dtype() == dtype) return moment;
  *converted = true;
  return moment.to(dtype);
}

std::string moments_converted_line(const std::string& checkpoint, DType dtype) {
  return fmt::format("checkpoint {}: its AdamW moments converted to {} (optim.state_dtype)", checkpoint,
                     dtype_name(dtype));
}

void check_checkpoint_state(const json& state, const std::string& folder) {
  MT_CHECK(state.is_object() && state.contains("step") && state.contains("optimizer_steps") && state.contains("data"),
           "checkpoint {}: {} lacks step, optimizer_steps or data", folder, kStateFile);
  for (const char* field : {"step", "optimizer_steps"}) {
    const json& value = state.at(field);
    MT_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                 (!value.is_number_unsigned() || value.get<uint64_t>() <= uint64_t{INT64_MAX}),
             "checkpoint {}: {} field '{}' is {}, expected a non-negative integer", folder, kStateFile, field,
             value.dump());
  }
  const int64_t step = state.at("step").get<int64_t>();
  // One optimizer step per training step at most: more is a corrupt or hand-edited state.
  MT_CHECK(state.at("optimizer_steps").get<int64_t>() <= step,
           "checkpoint {}: {} says optimizer_steps {} after step {}, expected at most one per step", folder, kStateFile,
           state.at("optimizer_steps").get<int64_t>(), step);
  // The folder (step_<N>) and its manifest name the step too; a state.json that disagrees would resume at the wrong
  // step and overwrite a good checkpoint.
  const fs::path normal = fs::path(folder).lexically_normal();
  const std::optional<int64_t> named =
      parse_step_folder((normal.has_filename() ? normal : normal.parent_path()).filename().string());
  MT_CHECK(!named || *named == step, "checkpoint {}: {} says step {}, the folder name says step {}", folder, kStateFile,
           step, named.value_or(0));
}

json parse_checkpoint_state(std::string_view text, const std::string& folder) {
  json state = parse_json_text(text, folder, kStateFile);
  check_checkpoint_state(state, folder);
  return state;
}

json parse_shard_layout(std::string_view text, const std::string& folder) {
  json layout = parse_json_text(text, folder, kShardLayout);
  check_shard_layout(layout, folder);
  return layout;
}

uint64_t fnv1a64(const void* bytes, size_t size) {
  const auto* p = static_cast<const uint8_t*>(bytes);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::string save_checkpoint(const std::string& dir, const CheckpointData& data, int64_t keep) {
  MT_CHECK(!dir.empty(), "checkpoint: the checkpoint folder is an empty path, expected a folder");
  MT_CHECK(data.step >= 0, "checkpoint: step is {}, expected a non-negative step", data.step);
  MT_CHECK(keep >= 0, "checkpoint: keep is {}, expected >= 0 (0 keeps every checkpoint)", keep);
  validate_tensors(data.model, "model");
  validate_tensors(data.optimizer, "optimizer");
  std::string state_text;
  try {
    state_text = data.state.dump(2) + "\n";
  } catch (const json::exception& e) {
    MT_FAIL("checkpoint: cannot encode the state as JSON (strings must be UTF-8): {}", e.what());
  }

  std::error_code error;
  const bool created = fs::create_directories(dir, error);
  MT_CHECK(!error, "checkpoint: cannot create checkpoint folder {}: {}", dir, error.message());
  if (created) {
    const fs::path parent = fs::absolute(fs::path(dir)).parent_path();
    fsync_folder(parent.string());
  }

  const std::string name = step_folder_name(data.step);
  const std::string final_path = (fs::path(dir) / name).string();
  const std::string tmp = (fs::path(dir) / fmt::format("{}{}{}", name, kTmpMarker, ::getpid())).string();
  fs::remove_all(tmp, error);  // left by an earlier process that had our pid
  MT_CHECK(!error, "checkpoint: cannot remove the stale folder {}: {}", tmp, error.message());
  MT_CHECK(fs::create_directory(tmp, error) && !error, "checkpoint: cannot create {}: {}", tmp,
           error ? error.message() : std::string("it exists"));
  write_in_temporary(tmp, [&] {
    const auto file_in_tmp = [&](const char* file) { return (fs::path(tmp) / file).string(); };
    io::write_safetensors(file_in_tmp(kModelFile), data.model);
    io::write_safetensors(file_in_tmp(kOptimizerFile), data.optimizer);
    write_new_file_synced(file_in_tmp(kStateFile), state_text);
    write_new_file_synced(file_in_tmp(kConfigFile), data.config_toml);
  });
  seal_and_publish(tmp, final_path, data.step,
                   std::vector<std::string>(std::begin(kRequiredFiles), std::end(kRequiredFiles)));
  return finish_save(dir, final_path, data.step, keep);
}

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  const std::map<int64_t, fs::path> folders = step_folders(dir);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string problem = completeness_problem(it->second, it->first);
    if (problem.empty()) return it->second.string();
    log_warn("checkpoint: skipping {}: {}", it->second.string(), problem);
  }
  return std::nullopt;
}

std::optional<std::pair<std::string, CheckpointData>> load_latest_checkpoint(const std::string& dir) {
  const std::map<int64_t, fs::path> folders = step_folders(dir);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string path = it->second.string();
    std::string problem = completeness_problem(it->second, it->first);
    if (problem.empty()) {
      try {
        return std::make_pair(path, load_checkpoint(path));
      } catch (const Error& e) {
        problem = e.what();
      }
    }
    log_warn("checkpoint: skipping {}: {}", path, problem);
  }
  return std::nullopt;
}

std::optional<int64_t> checkpoint_folder_step(const std::string& folder_name) { return parse_step_folder(folder_name); }

std::vector<int64_t> list_checkpoints(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& [step, folder] : step_folders(dir)) {
    if (completeness_problem(folder, step).empty()) steps.push_back(step);
  }
  return steps;
}

CheckpointData load_checkpoint(const std::string& path) {
  const Manifest manifest = verified_manifest(path, {});
  CheckpointData data;
  data.step = manifest.step;
  if (manifest.files.count(kShardLayout)) {
    const json layout = read_json_file(path, kShardLayout);
    check_shard_layout(layout, path);
    const int world = layout["world"].get<int>();
    for (int r = 0; r < world; ++r) {
      MT_CHECK(manifest.files.count(shard_file_name(r, world)), "checkpoint {}: {} does not list {}", path, kManifest,
               shard_file_name(r, world));
    }
    assemble_shards(path, layout, data);
  } else {
    data.model = read_tensors((fs::path(path) / kModelFile).string());
    data.optimizer = read_tensors((fs::path(path) / kOptimizerFile).string());
  }
  data.state = read_json_file(path, kStateFile);
  data.config_toml = read_text_file(path, kConfigFile);
  return data;
}

bool is_sharded_checkpoint(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(fs::path(path) / kShardLayout, error);
}

int sharded_checkpoint_world(const std::string& path) {
  try {
    const json layout = read_json_file(path, kShardLayout);
    return layout.is_object() && layout.contains("world") && layout["world"].is_number_integer()
               ? layout["world"].get<int>()
               : 0;
  } catch (const Error&) {
    return 0;
  }
}

CheckpointShard load_checkpoint_shard(const std::string& path, int rank) {
  const json layout_probe = read_json_file(path, kShardLayout);
  check_shard_layout(layout_probe, path);
  const int world = layout_probe["world"].get<int>();
  MT_CHECK(rank >= 0 && rank < world, "checkpoint {}: rank {} asked for its shard, but the checkpoint has {} ranks",
           path, rank, world);
  const std::string file = shard_file_name(rank, world);
  const Manifest manifest = verified_manifest(path, {kShardLayout, kStateFile, kConfigFile, file});
  MT_CHECK(manifest.files.count(kShardLayout) && manifest.files.count(file), "checkpoint {}: {} does not list {}", path,
           kManifest, manifest.files.count(kShardLayout) ? file : std::string(kShardLayout));
  CheckpointShard shard;
  shard.step = manifest.step;
  shard.layout = read_json_file(path, kShardLayout);  // the verified copy
  check_shard_layout(shard.layout, path);
  shard.state = read_json_file(path, kStateFile);
  shard.tensors = read_tensors((fs::path(path) / file).string());
  return shard;
}

void prepare_sharded_checkpoint(const std::string& dir, int64_t step) {
  MT_CHECK(!dir.empty(), "checkpoint: the checkpoint folder is an empty path, expected a folder");
  MT_CHECK(step >= 0, "checkpoint: step is {}, expected a non-negative step", step);
  std::error_code error;
  const bool created = fs::create_directories(dir, error);
  MT_CHECK(!error, "checkpoint: cannot create checkpoint folder {}: {}", dir, error.message());
  if (created) fsync_folder(fs::absolute(fs::path(dir)).parent_path().string());
  const std::string tmp = (fs::path(dir) / (step_folder_name(step) + kShardedTmpMarker)).string();
  fs::remove_all(tmp, error);  // left by a crashed save of the same step
  MT_CHECK(!error, "checkpoint: cannot remove the stale folder {}: {}", tmp, error.message());
  MT_CHECK(fs::create_directory(tmp, error) && !error, "checkpoint: cannot create {}: {}", tmp,
           error ? error.message() : std::string("it exists"));
}

void write_checkpoint_shard(const std::string& dir, int64_t step, int rank, int world, const NamedTensors& tensors) {
  MT_CHECK(world >= 1 && rank >= 0 && rank < world, "checkpoint: shard of rank {} in a world of {}", rank, world);
  validate_tensors(tensors, "shard");
  const fs::path tmp = fs::path(dir) / (step_folder_name(step) + kShardedTmpMarker);
  std::error_code error;
  MT_CHECK(fs::is_directory(tmp, error), "checkpoint: {} does not exist (rank 0 prepares it before the shards)",
           tmp.string());
  io::write_safetensors((tmp / shard_file_name(rank, world)).string(), tensors);
}

std::string complete_sharded_checkpoint(const std::string& dir, const CheckpointData& data, const json& layout,
                                        int64_t keep) {
  MT_CHECK(keep >= 0, "checkpoint: keep is {}, expected >= 0 (0 keeps every checkpoint)", keep);
  MT_CHECK(data.model.empty() && data.optimizer.empty(),
           "checkpoint: a sharded checkpoint's tensors are in its shard files, not in the model and optimizer lists");
  const std::string name = step_folder_name(data.step);
  const std::string tmp = (fs::path(dir) / (name + kShardedTmpMarker)).string();
  const std::string final_path = (fs::path(dir) / name).string();
  std::vector<std::string> files;
  write_in_temporary(tmp, [&] {
    std::error_code error;
    check_shard_layout(layout, tmp);
    const int world = layout["world"].get<int>();
    for (int r = 0; r < world; ++r) {
      files.push_back(shard_file_name(r, world));
      MT_CHECK(fs::is_regular_file(fs::path(tmp) / files.back(), error), "checkpoint: {} lacks {} (rank {})", tmp,
               files.back(), r);
    }
    const auto file_in_tmp = [&](const std::string& file) { return (fs::path(tmp) / file).string(); };
    write_new_file_synced(file_in_tmp(kStateFile), data.state.dump(2) + "\n");
    write_new_file_synced(file_in_tmp(kConfigFile), data.config_toml);
    write_new_file_synced(file_in_tmp(kShardLayout), layout.dump(1) + "\n");
    files.insert(files.end(), {kStateFile, kConfigFile, kShardLayout});
  });
  seal_and_publish(tmp, final_path, data.step, files);
  return finish_save(dir, final_path, data.step, keep);
}

}  // namespace moetrain::train
