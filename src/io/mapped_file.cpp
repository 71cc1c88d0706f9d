// defines: MappedFile: open, fstat and mmap of a whole file, each call checked.
#include "io/mapped_file.h"

#include <cerrno>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"

namespace moetrain::io {

namespace {

std::string errno_text(int error) { return std::system_category().message(error); }

// Closes the descriptor on every path out of open(); the mapping outlives it.
struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  // stat first: opening a FIFO blocks until a writer comes, so a non-regular file is refused before the open (and
  // O_NONBLOCK keeps one swapped in between from blocking; it changes nothing for a regular file).
  struct stat before {};
  MT_CHECK(::stat(path.c_str(), &before) == 0, "mapped file: cannot open {}: {}", path, errno_text(errno));
  MT_CHECK(S_ISREG(before.st_mode), "mapped file: {} is not a regular file (expected a file to map)", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  MT_CHECK(fd >= 0, "mapped file: cannot open {}: {}", path, errno_text(errno));
  FdCloser closer{fd};

  struct stat info {};
  MT_CHECK(::fstat(fd, &info) == 0, "mapped file: cannot stat {}: {}", path, errno_text(errno));
  MT_CHECK(S_ISREG(info.st_mode), "mapped file: {} is not a regular file (expected a file to map)", path);
  const size_t size = static_cast<size_t>(info.st_size);
  if (size == 0) return std::shared_ptr<MappedFile>(new MappedFile(path, nullptr, 0));

  void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  MT_CHECK(data != MAP_FAILED, "mapped file: cannot map {} ({} bytes): {}", path, size, errno_text(errno));
  return std::shared_ptr<MappedFile>(new MappedFile(path, static_cast<const uint8_t*>(data), size));
}

MappedFile::MappedFile(std::string path, const uint8_t* data, size_t size)
    : path_(std::move(path)), data_(data), size_(size) {}

MappedFile::~MappedFile() {
  // munmap of a mapping we created cannot fail in a way a destructor could act on.
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace moetrain::io
