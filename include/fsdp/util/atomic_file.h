#pragma once
// A utility, not part of the training API: replace a file so that a reader (or a crash) sees either the old
// bytes or the new ones, never a torn file. The library's writers (checkpoint metadata, safetensors files and
// indexes, config.json) all go through it; apps and tools may use it the same way.
//
// How: the bytes go to a temporary file beside the target whose name is unique per process and per call
// ("<target>.tmp.<pid>.<n>", created with O_EXCL), which is fsynced, closed and renamed over the target; with
// DirSync::Yes the directory is fsynced after the rename, so the new name itself survives a power cut (what a
// checkpoint needs). Until commit() succeeds the temporary is removed when the AtomicFile goes away, whatever
// threw, so a failed write leaves the old file as it was and no temporary behind.
#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp::util {

enum class DirSync { No, Yes };

class AtomicFile {
 public:
  // Creates the temporary (mode 0644 before the umask, like open(2)/fopen). `what` prefixes every error
  // ("checkpoint", "safetensors", ...), so a message says which writer failed.
  explicit AtomicFile(std::string target, std::string what = "write");
  ~AtomicFile();  // removes the temporary unless commit() succeeded
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends n bytes (retries short writes and EINTR; throws c10::Error naming the temporary on failure).
  void write(const void* data, int64_t n);
  void write(std::string_view bytes) { write(bytes.data(), static_cast<int64_t>(bytes.size())); }
  // fsync, close, rename over the target, then (DirSync::Yes) fsync the target's directory.
  void commit(DirSync dir_sync);

  const std::string& target() const { return target_; }
  const std::string& temp_path() const { return temp_; }

 private:
  std::string target_;
  std::string what_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// The whole file in one call: AtomicFile(target, what), write(bytes), commit(dir_sync).
void write_file_atomic(const std::string& target, std::string_view bytes, DirSync dir_sync,
                       const std::string& what = "write");

// fsync of a directory (after a rename or a create in it, so the name is durable); "" means ".".
void fsync_dir(const std::string& dir, const std::string& what = "write");

}  // namespace fsdp::util
