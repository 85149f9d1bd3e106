#pragma once
// TensorBoard event files (metrics.enable_tensorboard), as TorchTitan's SummaryWriter writes them: one file
// <job.dump_folder>/<metrics.save_tb_folder>/<YYYYmmdd-HHMM>[/rank_<r>]/events.out.tfevents.<time>.<host>.<pid>
// of TFRecords, each an Event protobuf (tensorboard_event.proto: TensorFlow's field numbers) framed as
//   uint64 length, uint32 masked CRC32C(length), bytes, uint32 masked CRC32C(bytes)   (little-endian)
// with masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. Protobuf serialises, crcutil computes CRC32C (both
// Debian packages). The first record carries file_version "brain.Event:2"; each scalar is a Summary value with a
// simple_value. Records are flushed as written, so TensorBoard can watch a running job. No torch headers.

#include <cstdint>
#include <fstream>
#include <string>

namespace fsdp_train {

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;
  // Creates `log_dir` and a new event file in it.
  explicit TensorBoardWriter(const std::string& log_dir);
  bool is_open() const { return out_.is_open(); }
  void add_scalar(const std::string& tag, double value, int64_t step);
  void flush();
  const std::string& path() const { return path_; }
  const std::string& log_dir() const { return log_dir_; }

 private:
  void write_record(const std::string& bytes);
  std::string log_dir_, path_;
  std::ofstream out_;
};

// CRC32C (Castagnoli) of `size` bytes, and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

// TorchTitan's folder: <dump>/<save_tb_folder>/<YYYYmmdd-HHMM> (+ /rank_<r> when every rank writes).
std::string tensorboard_log_dir(const std::string& dump_folder, const std::string& save_tb_folder, bool per_rank, int rank);

}  // namespace fsdp_train
