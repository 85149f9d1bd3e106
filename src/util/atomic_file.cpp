// Atomic file replacement (see include/fsdp/util/atomic_file.h).
#include <fsdp/util/atomic_file.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fsdp::util {
namespace {

// Unique among this process's calls; the pid makes it unique among processes writing the same target.
std::string temp_name_for(const std::string& target) {
  static std::atomic<uint64_t> counter{0};
  return target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
}

}  // namespace

AtomicFile::AtomicFile(std::string target, std::string what)
    : target_(std::move(target)), what_(std::move(what)), temp_(temp_name_for(target_)) {
  // O_EXCL: a stale temporary of a dead process with a recycled pid is never written into (or truncated).
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, what_, ": cannot create ", temp_, ": ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, int64_t n) {
  TORCH_CHECK(fd_ >= 0, what_, ": ", temp_, " is already closed");
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd_, p, static_cast<size_t>(std::min<int64_t>(n, int64_t(1) << 30)));
    if (put < 0 && errno == EINTR) continue;
    TORCH_CHECK(put > 0, what_, ": writing ", temp_, " failed: ", std::strerror(errno));
    p += put, n -= put;
  }
}

void AtomicFile::commit(DirSync dir_sync) {
  TORCH_CHECK(fd_ >= 0, what_, ": ", temp_, " is already closed");
  TORCH_CHECK(::fsync(fd_) == 0, what_, ": fsync of ", temp_, " failed: ", std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(rc == 0, what_, ": closing ", temp_, " failed: ", std::strerror(errno));
  TORCH_CHECK(::rename(temp_.c_str(), target_.c_str()) == 0, what_, ": cannot rename ", temp_, " to ", target_, ": ",
              std::strerror(errno));
  committed_ = true;
  if (dir_sync == DirSync::Yes) fsync_dir(std::filesystem::path(target_).parent_path().string(), what_);
}

void write_file_atomic(const std::string& target, std::string_view bytes, DirSync dir_sync, const std::string& what) {
  AtomicFile file(target, what);
  file.write(bytes);
  file.commit(dir_sync);
}

void fsync_dir(const std::string& dir, const std::string& what) {
  const std::string name = dir.empty() ? "." : dir;
  const int fd = ::open(name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, what, ": cannot open directory ", name, ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, what, ": fsync of directory ", name, " failed: ", std::strerror(err));
}

}  // namespace fsdp::util
