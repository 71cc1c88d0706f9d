// defines: the exclusive temporary files and atomic whole-file writes of atomic_file.h.
#include "io/atomic_file.h"

#include <cerrno>
#include <filesystem>
#include <system_error>

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include "core/error.h"

namespace moetrain::io {

namespace {

std::string errno_text(int error) { return std::system_category().message(error); }

// Stale names (left by crashed writers of this pid) are skipped, not reused; this many is far more than any run
// leaves behind.
constexpr int kMaxTemporaryAttempts = 1000;

void write_all(int fd, const void* data, size_t bytes, const std::string& tmp, const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    const ssize_t written = ::write(fd, p, left);
    if (written < 0 && errno == EINTR) continue;
    MT_CHECK(written > 0, "{}: cannot write {} ({} bytes left): {}", what, tmp, left,
             written < 0 ? errno_text(errno) : std::string("write wrote nothing"));
    p += written;
    left -= static_cast<size_t>(written);
  }
}

}  // namespace

int create_temporary_beside(const std::string& path, std::string* tmp) {
  for (int n = 0; n < kMaxTemporaryAttempts; ++n) {
    *tmp = fmt::format("{}.tmp-{}-{}", path, ::getpid(), n);
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    MT_CHECK(errno == EEXIST, "cannot create {} (the temporary file of {}): {}", *tmp, path, errno_text(errno));
  }
  MT_FAIL("cannot create a temporary file beside {}: {} names {}.tmp-{}-* exist already", path, kMaxTemporaryAttempts,
          path, ::getpid());
}

void fsync_folder_of(const std::string& path, const std::string& what) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::filesystem::path folder_path = parent.empty() ? std::filesystem::path(".") : parent;
  const std::string folder = folder_path.string();
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "{}: cannot open folder {} to sync it: {}", what, folder, errno_text(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  MT_CHECK(rc == 0, "{}: cannot sync folder {}: {}", what, folder, errno_text(error));
}

void write_file_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& chunks,
                           const std::string& what) {
  std::string tmp;
  int fd = create_temporary_beside(path, &tmp);
  try {
    for (const auto& [data, bytes] : chunks) write_all(fd, data, bytes, tmp, what);
    MT_CHECK(::fsync(fd) == 0, "{}: cannot sync {}: {}", what, tmp, errno_text(errno));
    const int rc = ::close(fd);
    fd = -1;
    MT_CHECK(rc == 0, "{}: cannot close {}: {}", what, tmp, errno_text(errno));
    // rename replaces the name `path` (a symlink there is replaced, never followed).
    MT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "{}: cannot rename {} to {}: {}", what, tmp, path,
             errno_text(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_folder_of(path, what);
}

}  // namespace moetrain::io
