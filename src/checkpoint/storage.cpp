// Storage layer (see storage.h).
#include "checkpoint/storage.h"

#include "checkpoint/format.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>

namespace fsdp::checkpoint::detail {
namespace fs = std::filesystem;

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot create ", path_, ": ", std::strerror(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t FileWriter::append(const void* data, int64_t n) {
  TORCH_CHECK(fd_ >= 0, "checkpoint: ", path_, " is closed");
  const int64_t at = size_;
  const auto* p = static_cast<const char*>(data);
  int64_t left = n;
  while (left > 0) {
    const ssize_t put = ::write(fd_, p, static_cast<size_t>(std::min<int64_t>(left, int64_t(1) << 30)));
    if (put < 0 && errno == EINTR) continue;
    TORCH_CHECK(put > 0, "checkpoint: writing ", path_, " at byte ", size_, " failed: ", std::strerror(errno));
    p += put, left -= put, size_ += put;
  }
  return at;
}

void FileWriter::fsync() {
  TORCH_CHECK(fd_ >= 0 && ::fsync(fd_) == 0, "checkpoint: fsync of ", path_, " failed: ", std::strerror(errno));
}

void FileWriter::close() {
  if (fd_ < 0) return;
  const int rc = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(rc == 0, "checkpoint: closing ", path_, " failed: ", std::strerror(errno));
}

RangeReader::RangeReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot open ", path_, ": ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd_, &st) == 0, "checkpoint: cannot stat ", path_, ": ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), "checkpoint: ", path_, " is not a regular file");
  size_ = st.st_size;
}

RangeReader::~RangeReader() {
  if (fd_ >= 0) ::close(fd_);
}

void RangeReader::read(int64_t offset, int64_t n, void* dst) const {
  TORCH_CHECK(offset >= 0 && n >= 0 && offset <= size_ && n <= size_ - offset, "checkpoint: read of bytes [", offset,
              ", +", n, ") outside ", path_, " (", size_, " bytes)");
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, static_cast<size_t>(std::min<int64_t>(n, int64_t(1) << 30)), offset);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, "checkpoint: reading ", path_, " at byte ", offset, " failed: ",
                got == 0 ? "unexpected end of file (truncated?)" : std::strerror(errno));
    p += got, n -= got, offset += got;
  }
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open directory ", dir, ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: fsync of directory ", dir, " failed: ", std::strerror(err));
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    FileWriter w(tmp);
    w.append(text.data(), static_cast<int64_t>(text.size()));
    w.fsync();
    w.close();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "checkpoint: cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
  fsync_dir(fs::path(path).parent_path().string());
}

std::string read_small_file(const std::string& path, int64_t max_bytes) {
  RangeReader r(path);
  TORCH_CHECK(r.size() <= max_bytes, "checkpoint: ", path, " is ", r.size(), " bytes (limit ", max_bytes, ")");
  std::string out(static_cast<size_t>(r.size()), '\0');
  r.read(0, r.size(), out.data());
  return out;
}

// POSIX (nftw, depth first, no symlink followed) rather than std::filesystem::remove_all: torch wheels export a
// broken copy of the latter from libtorch.so (pytorch#133437), which a program that links libtorch ahead of
// libstdc++ calls instead of the real one (see src/CMakeLists.txt).
void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p) == 0 ? 0 : errno; };
  const int err = ::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
  TORCH_CHECK(err == 0, "checkpoint: cannot remove ", path, ": ", std::strerror(err > 0 ? err : errno));
}

void commit_dir(const std::string& tmp, const std::string& final_dir) {
  const std::string parent = fs::path(final_dir).parent_path().string();
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    // Atomically swap the new checkpoint in; the old one ends up under the temporary name.
    TORCH_CHECK(::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0,
                "checkpoint: cannot replace ", final_dir, " by ", tmp, ": ", std::strerror(errno));
    fsync_dir(parent.empty() ? "." : parent);
    remove_tree(tmp);
  } else {
    TORCH_CHECK(::rename(tmp.c_str(), final_dir.c_str()) == 0, "checkpoint: cannot rename ", tmp, " to ", final_dir,
                ": ", std::strerror(errno));
  }
  fsync_dir(parent.empty() ? "." : parent);
}

std::string step_dir(const std::string& folder, int64_t step) {
  return (fs::path(folder) / ("step-" + std::to_string(step))).string();
}

std::vector<int64_t> complete_steps(const std::string& folder) {
  std::vector<int64_t> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  static const std::regex pattern("step-([0-9]{1,18})");
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, pattern)) continue;
    // libfsdp's metadata.json, or PyTorch DCP's .metadata (both written last: their presence marks completeness).
    if (!fs::is_regular_file(entry.path() / kMetadataFile, ec) && !fs::is_regular_file(entry.path() / ".metadata", ec))
      continue;
    out.push_back(std::stoll(m[1].str()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace fsdp::checkpoint::detail
