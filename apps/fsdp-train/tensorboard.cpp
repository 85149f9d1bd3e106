// TensorBoard event files (see tensorboard.h).
#include "tensorboard.h"

#include "tensorboard_event.pb.h"

#include <generic_crc.h>  // crcutil (libcrcutil-dev)

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <stdexcept>

namespace fsdp_train {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// CRC32C: the reflected Castagnoli polynomial 0x82f63b78, initial value and final xor ~0 ("canonical").
const crcutil::GenericCrc<crcutil::uint64, crcutil::uint64, crcutil::uint64, 4>& castagnoli() {
  static const crcutil::GenericCrc<crcutil::uint64, crcutil::uint64, crcutil::uint64, 4> crc(0x82f63b78, 32, true);
  return crc;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) { return static_cast<uint32_t>(castagnoli().CrcDefault(data, size, 0)); }

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tensorboard_log_dir(const std::string& dump_folder, const std::string& save_tb_folder, bool per_rank, int rank) {
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M", &tm);
  std::filesystem::path dir = std::filesystem::path(dump_folder) / save_tb_folder / stamp;
  if (per_rank) dir /= "rank_" + std::to_string(rank);
  return dir.string();
}

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) : log_dir_(log_dir) {
  std::filesystem::create_directories(log_dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  // The name TensorFlow's EventFileWriter gives (TensorBoard only reads files with "tfevents" in the name).
  path_ = (std::filesystem::path(log_dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) +
                                             "." + host + "." + std::to_string(getpid()) + ".0"))
              .string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("metrics.enable_tensorboard: cannot write '" + path_ + "'");
  tensorboard_subset::Event first;
  first.set_wall_time(now_seconds());
  first.set_file_version("brain.Event:2");
  write_record(first.SerializeAsString());
  flush();
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  if (!out_.is_open()) return;
  tensorboard_subset::Event e;
  e.set_wall_time(now_seconds());
  e.set_step(step);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  write_record(e.SerializeAsString());
}

void TensorBoardWriter::flush() {
  if (!out_.is_open()) return;
  out_.flush();
  if (!out_) throw std::runtime_error("metrics.enable_tensorboard: write to '" + path_ + "' failed");
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  // TFRecord framing, little-endian (as TensorFlow writes it on every platform).
  auto put_le = [this](uint64_t v, int n) {
    char b[8];
    for (int i = 0; i < n; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    out_.write(b, n);
  };
  const uint64_t length = bytes.size();
  char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  out_.write(len_le, 8);
  put_le(masked_crc32c(len_le, 8), 4);
  out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  put_le(masked_crc32c(bytes.data(), bytes.size()), 4);
}

}  // namespace fsdp_train
