#pragma once
// Storage layer of distributed checkpoints: files on a POSIX file system. Appending writers, positioned
// range reads (pread: a reader fetches only the bytes it needs), fsync of files and directories, atomic
// directory commit (one rename; RENAME_EXCHANGE over an existing checkpoint), listing and purging step-N
// folders. No tensors, no collectives.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// Appends to a new file (truncated); fsync() flushes data to disk; close() (or fsync) makes every appended byte
// part of the file. The destructor only closes: a writer dropped on an error path leaves a partial file.
//
// Direct mode writes with O_DIRECT through an aligned staging buffer, bypassing the page cache. Why: a large
// checkpoint written through the page cache is copied there, then written back by the kernel under dirty-page
// throttling; on this project's disk large aligned direct writes reached up to twice (median 1.5x) the
// bandwidth of buffered writes + fsync (bench/RESULTS.md). Appends are copied into the staging buffer (grown on demand up to
// kMaxStageBytes) and written in whole aligned blocks; a source that is already aligned is written straight from
// its memory. The last partial block is written padded and the file truncated to its real size. Where the file
// system refuses O_DIRECT (at open or at the first write), the writer falls back to buffered writes.
class FileWriter {
 public:
  enum class Mode { Buffered, Direct };
  static constexpr int64_t kDirectAlign = 4096;
  static constexpr int64_t kMaxStageBytes = int64_t{64} << 20;
  // max_stage_bytes: the staging buffer's largest size in direct mode (a multiple of kDirectAlign; tests use
  // small ones to reach every path with small files).
  explicit FileWriter(std::string path, Mode mode = Mode::Buffered, int64_t max_stage_bytes = kMaxStageBytes);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  // Appends n bytes; returns the byte offset they start at.
  int64_t append(const void* data, int64_t n);
  int64_t size() const { return size_; }
  void fsync();
  void close();
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }  // false after a fallback to buffered writes


 private:
  struct FreeAligned {
    void operator()(char* p) const;
  };
  void write_at(const char* p, int64_t n, int64_t offset);  // pwrite all of it; O_DIRECT rules when direct_
  void flush_stage(bool include_partial_block);
  void fall_back_to_buffered();

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  bool direct_ = false;
  // Direct mode: stage_ holds the file's last staged_ bytes, [size_ - staged_, size_); that start is aligned.
  std::unique_ptr<char, FreeAligned> stage_;
  int64_t stage_capacity_ = 0;
  int64_t max_stage_bytes_ = kMaxStageBytes;
  int64_t staged_ = 0;
  bool stage_clean_ = false;  // the staged bytes are on disk already (padded by the last fsync)
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
// Writes `text` to `path` through a temporary file in the same directory: write, fsync, rename, fsync dir
// (fsdp::util::write_file_atomic with DirSync::Yes and "checkpoint" errors).
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
