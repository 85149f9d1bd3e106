// FileWriter, buffered and direct (O_DIRECT through an aligned staging buffer): whatever the sizes and alignment
// of the appends, and with fsyncs in between, the file holds exactly the appended bytes (the reference is the
// same byte sequence kept in memory), offsets are where append() said, and the file has no padding left.
#include "checkpoint/storage.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using fsdp::checkpoint::detail::FileWriter;

namespace {

// A small staging maximum reaches the growth, full-buffer and larger-than-the-buffer paths with small files.
// Growth starts at 1 MiB, so 4 MiB exercises growing (1 -> 2 -> 4 MiB) and flushing a full buffer.
constexpr int64_t kStage = int64_t{4} << 20;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/fsdp_storage_" + name + "_" + std::to_string(::getpid());
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// An aligned buffer of random bytes: appends can then start at aligned and at unaligned addresses.
struct Source {
  explicit Source(int64_t n) : bytes(static_cast<size_t>(n) + 2 * FileWriter::kDirectAlign) {
    std::mt19937 gen(7);
    for (auto& b : bytes) b = static_cast<char>(gen());
  }
  const char* aligned(int64_t shift) const {
    const auto base = reinterpret_cast<uintptr_t>(bytes.data());
    const uintptr_t a = (base + FileWriter::kDirectAlign - 1) / FileWriter::kDirectAlign * FileWriter::kDirectAlign;
    return reinterpret_cast<const char*>(a) + shift;
  }
  std::vector<char> bytes;
};

// Appends of these sizes, each from an aligned address when `aligned_src`, else one byte past one.
void write_and_check(FileWriter::Mode mode, const std::vector<int64_t>& sizes, bool aligned_src,
                     const std::vector<size_t>& fsync_after, const std::string& name) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const Source src(total + 1);
  const std::string path = temp_path(name);
  std::string expect;
  {
    FileWriter w(path, mode, kStage);
    int64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const char* p = src.aligned(aligned_src ? 0 : 1) + at;
      EXPECT_EQ(w.append(p, sizes[i]), static_cast<int64_t>(expect.size())) << name << ": append " << i;
      expect.append(p, static_cast<size_t>(sizes[i]));
      at += sizes[i];
      if (std::find(fsync_after.begin(), fsync_after.end(), i) != fsync_after.end()) {
        w.fsync();
        // After an fsync the file is exactly what was appended so far: the padded last block was cut back.
        EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)), w.size()) << name << ": after fsync " << i;
        EXPECT_EQ(slurp(path), expect) << name << ": after fsync " << i;
      }
    }
    EXPECT_EQ(w.size(), static_cast<int64_t>(expect.size()));
    w.fsync();
    w.close();
  }
  const std::string got = slurp(path);
  ASSERT_EQ(got.size(), expect.size()) << name;
  EXPECT_TRUE(got == expect) << name << ": the file differs from the appended bytes";
  fs::remove(path);
}

}  // namespace

TEST(FileWriter, DirectModeIsUsedOnThisFileSystem) {
  // The test directory's file system accepts O_DIRECT (ext4/xfs); otherwise the other tests only cover the
  // fallback, which must then be said.
  const std::string path = temp_path("probe");
  FileWriter w(path, FileWriter::Mode::Direct);
  const Source src(3 * FileWriter::kDirectAlign);
  w.append(src.aligned(1), 3 * FileWriter::kDirectAlign - 5);
  w.fsync();
  EXPECT_TRUE(w.direct()) << ::testing::TempDir() << " refuses O_DIRECT: only the fallback was tested";
  EXPECT_FALSE(FileWriter(path + ".b", FileWriter::Mode::Buffered).direct());
  fs::remove(path);
  fs::remove(path + ".b");
}

TEST(FileWriter, EverySizeAndAlignmentRoundTrips) {
  const int64_t A = FileWriter::kDirectAlign;
  const int64_t M = kStage;
  // Small and odd sizes, exact blocks, sizes around the staging buffer's growth steps and its maximum, and one
  // append larger than the maximum.
  const std::vector<int64_t> sizes = {1,     A - 1, 1,     A,         A + 1, 3 * A, 7,        (1 << 20) - 3,
                                      1 << 20, 5,   M - 11, M + A + 3, 2 * A, 0,     M + 17, 9};
  for (auto mode : {FileWriter::Mode::Direct, FileWriter::Mode::Buffered}) {
    const std::string m = mode == FileWriter::Mode::Direct ? "direct" : "buffered";
    for (bool aligned : {true, false}) {
      const std::string name = m + (aligned ? "_aligned" : "_unaligned");
      write_and_check(mode, sizes, aligned, /*fsync_after=*/{}, name);
      write_and_check(mode, sizes, aligned, /*fsync_after=*/{0, 2, 4, 9, 11}, name + "_fsyncs");
    }
  }
}

TEST(FileWriter, CloseWithoutFsyncKeepsEveryByte) {
  const std::string path = temp_path("close");
  const Source src(10000);
  {
    FileWriter w(path, FileWriter::Mode::Direct);
    w.append(src.aligned(3), 10000);
    w.close();  // no fsync: the staged tail must still reach the file
  }
  EXPECT_EQ(slurp(path), std::string(src.aligned(3), 10000));
  fs::remove(path);
}
