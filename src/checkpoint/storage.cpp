// Storage layer (see storage.h).
#include "checkpoint/storage.h"

#include "checkpoint/format.h"

#include <fsdp/checkpoint/checkpoint.h>  // checkpoint_format: the one format detection
#include <fsdp/util/atomic_file.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>

namespace fsdp::checkpoint::detail {
namespace fs = std::filesystem;

namespace {
int open_for_write(const std::string& path, bool direct) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
}
int64_t round_down(int64_t n, int64_t a) { return n / a * a; }
int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }
}  // namespace

void FileWriter::FreeAligned::operator()(char* p) const { std::free(p); }

FileWriter::FileWriter(std::string path, Mode mode, int64_t max_stage_bytes)
    : path_(std::move(path)), max_stage_bytes_(max_stage_bytes) {
  TORCH_CHECK(max_stage_bytes > 0 && max_stage_bytes % kDirectAlign == 0, "checkpoint: FileWriter staging size ",
              max_stage_bytes, " is not a positive multiple of ", kDirectAlign);
  if (mode == Mode::Direct) {
    fd_ = open_for_write(path_, true);
    direct_ = fd_ >= 0;  // else (EINVAL: no O_DIRECT here) the buffered open below reports any real problem
  }
  if (fd_ < 0) fd_ = open_for_write(path_, false);
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot create ", path_, ": ", std::strerror(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::fall_back_to_buffered() {
  const int flags = ::fcntl(fd_, F_GETFL);
  TORCH_CHECK(flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0, "checkpoint: ", path_,
              ": cannot turn off O_DIRECT: ", std::strerror(errno));
  direct_ = false;
}

void FileWriter::write_at(const char* p, int64_t n, int64_t offset) {
  while (n > 0) {
    const ssize_t put = ::pwrite(fd_, p, static_cast<size_t>(std::min<int64_t>(n, int64_t(1) << 30)), offset);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0 && errno == EINVAL && direct_) {  // the file system refuses this direct write: go on buffered
      fall_back_to_buffered();
      continue;
    }
    TORCH_CHECK(put > 0, "checkpoint: writing ", path_, " at byte ", offset, " failed: ", std::strerror(errno));
    p += put, n -= put, offset += put;
  }
}

void FileWriter::flush_stage(bool include_partial_block) {
  if (staged_ == 0 || stage_clean_) return;
  const int64_t stage_offset = size_ - staged_;  // where the staged bytes belong in the file
  if (!direct_) {
    write_at(stage_.get(), staged_, stage_offset);
    staged_ = 0;
    return;
  }
  const int64_t whole = round_down(staged_, kDirectAlign);
  const int64_t tail = staged_ - whole;
  if (include_partial_block && tail > 0) {
    // The last block padded with zeros (the capacity is a multiple of the alignment), then the file cut back to
    // its real size. The tail stays staged: later appends rewrite its block with more data.
    const int64_t padded = round_up(staged_, kDirectAlign);
    std::memset(stage_.get() + staged_, 0, static_cast<size_t>(padded - staged_));
    write_at(stage_.get(), padded, stage_offset);
    TORCH_CHECK(::ftruncate(fd_, size_) == 0, "checkpoint: truncating ", path_, " to ", size_, " bytes failed: ",
                std::strerror(errno));
    stage_clean_ = true;
  } else if (whole > 0) {
    write_at(stage_.get(), whole, stage_offset);
  }
  if (whole > 0) {
    std::memmove(stage_.get(), stage_.get() + whole, static_cast<size_t>(tail));
    staged_ = tail;
  }
}

int64_t FileWriter::append(const void* data, int64_t n) {
  TORCH_CHECK(fd_ >= 0, "checkpoint: ", path_, " is closed");
  TORCH_CHECK(n >= 0, "checkpoint: negative append to ", path_);
  const int64_t at = size_;
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!direct_) {
      flush_stage(false);  // what was staged before a fallback goes first (or is on disk already)
      staged_ = 0;
      write_at(p, n, size_);
      size_ += n;
      break;
    }
    stage_clean_ = false;
    if (staged_ == 0 && reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0 && n >= kDirectAlign) {
      // An aligned source at an aligned file position: its whole blocks go straight from where they are.
      const int64_t whole = round_down(n, kDirectAlign);
      write_at(p, whole, size_);
      p += whole, n -= whole, size_ += whole;
      continue;
    }
    if (staged_ == stage_capacity_) {
      if (stage_capacity_ < max_stage_bytes_) {
        // Grow (1 MiB, doubling) rather than write small blocks: small checkpoints stay small in memory.
        const int64_t capacity =
            std::min(max_stage_bytes_, std::max<int64_t>(int64_t{1} << 20, 2 * stage_capacity_));
        void* raw = nullptr;
        TORCH_CHECK(::posix_memalign(&raw, static_cast<size_t>(kDirectAlign), static_cast<size_t>(capacity)) == 0,
                    "checkpoint: cannot allocate a ", capacity, "-byte staging buffer for ", path_);
        std::unique_ptr<char, FreeAligned> grown(static_cast<char*>(raw));
        if (staged_ > 0) std::memcpy(grown.get(), stage_.get(), static_cast<size_t>(staged_));
        stage_ = std::move(grown);
        stage_capacity_ = capacity;
      } else {
        flush_stage(false);
        continue;  // a fallback inside the flush switches this append to buffered writes
      }
    }
    const int64_t take = std::min(n, stage_capacity_ - staged_);
    std::memcpy(stage_.get() + staged_, p, static_cast<size_t>(take));
    staged_ += take, p += take, n -= take, size_ += take;
  }
  return at;
}

void FileWriter::fsync() {
  TORCH_CHECK(fd_ >= 0, "checkpoint: ", path_, " is closed");
  flush_stage(true);
  TORCH_CHECK(::fsync(fd_) == 0, "checkpoint: fsync of ", path_, " failed: ", std::strerror(errno));
}

void FileWriter::close() {
  if (fd_ < 0) return;
  try {
    flush_stage(true);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  const int rc = ::close(fd_);
  fd_ = -1;
  stage_.reset();
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

void fsync_dir(const std::string& dir) { util::fsync_dir(dir, "checkpoint"); }

void write_file_atomic(const std::string& path, const std::string& text) {
  util::write_file_atomic(path, text, util::DirSync::Yes, "checkpoint");
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
    if (!checkpoint_format(entry.path().string())) continue;
    out.push_back(std::stoll(m[1].str()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace fsdp::checkpoint::detail
