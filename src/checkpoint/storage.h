#pragma once
// Storage layer of distributed checkpoints: files on a POSIX file system. Appending writers, positioned
// range reads (pread: a reader fetches only the bytes it needs), fsync of files and directories, atomic
// directory commit (one rename; RENAME_EXCHANGE over an existing checkpoint), listing and purging step-N
// folders. No tensors, no collectives.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// Appends to a new file (truncated); fsync() flushes data to disk. Closes in the destructor.
class FileWriter {
 public:
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  // Appends n bytes; returns the byte offset they start at.
  int64_t append(const void* data, int64_t n);
  int64_t size() const { return size_; }
  void fsync();
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// Positioned reads of one file. Every read is bounds-checked against the size seen at open.
class RangeReader {
 public:
  explicit RangeReader(std::string path);
  ~RangeReader();
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;
  int64_t size() const { return size_; }
  void read(int64_t offset, int64_t n, void* dst) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

void fsync_dir(const std::string& dir);
// Writes `text` to `path` through a temporary file in the same directory: write, fsync, rename, fsync dir.
void write_file_atomic(const std::string& path, const std::string& text);
// Reads a whole file, refusing files larger than max_bytes (error naming the file).
std::string read_small_file(const std::string& path, int64_t max_bytes);
// Makes `tmp` visible as `final_dir` with one rename (exchanging with an existing `final_dir`, whose old
// contents are then deleted), then fsyncs the parent directory.
void commit_dir(const std::string& tmp, const std::string& final_dir);
void remove_tree(const std::string& path);  // no error when absent

// step-N folders under `folder` that hold a metadata.json or a DCP .metadata (complete checkpoints), ascending by N.
std::vector<int64_t> complete_steps(const std::string& folder);
std::string step_dir(const std::string& folder, int64_t step);

}  // namespace fsdp::checkpoint::detail
