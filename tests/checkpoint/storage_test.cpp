// FileWriter, buffered and direct (O_DIRECT through an aligned staging buffer): whatever the sizes and alignment
// of the appends, and with fsyncs in between, the file holds exactly the appended bytes (the reference is the
// same byte sequence kept in memory), offsets are where append() said, and the file has no padding left.
// AtomicFile (fsdp/util/atomic_file.h), the one "temporary, fsync, rename" writer behind every file the library
// replaces: concurrent writers of one target never leave a torn file, a failure leaves the old file and no temporary.
#include "checkpoint/storage.h"

#include <fsdp/util/atomic_file.h>

#include <c10/util/Exception.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
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

namespace {

// Names in `dir` that start with `prefix` + ".tmp": the temporaries a writer of `prefix` may leave.
std::vector<std::string> temporaries_of(const std::string& target) {
  std::vector<std::string> out;
  const fs::path t(target);
  for (const auto& e : fs::directory_iterator(t.parent_path())) {
    const std::string name = e.path().filename().string();
    if (name.rfind(t.filename().string() + ".tmp", 0) == 0) out.push_back(name);
  }
  return out;
}

// A whole file of writer k: `size` bytes, every one 'A' + k (so a torn or mixed file cannot pass as whole).
std::string version_of(int k) { return std::string(static_cast<size_t>(200'000 + 70'000 * k), static_cast<char>('A' + k)); }

}  // namespace

TEST(AtomicFile, ConcurrentWritersOfOneTargetNeverTearIt) {
  const std::string target = temp_path("atomic_concurrent");
  fs::remove(target);
  constexpr int kWriters = 2;
  constexpr int kRewrites = 150;
  std::vector<pid_t> children;
  for (int k = 0; k < kWriters; ++k) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {  // a writer process: rewrites the target again and again, then exits 0 (1 on any error)
      int rc = 0;
      try {
        const std::string bytes = version_of(k);
        for (int i = 0; i < kRewrites; ++i) fsdp::util::write_file_atomic(target, bytes, fsdp::util::DirSync::No, "test");
      } catch (...) {
        rc = 1;
      }
      ::_exit(rc);
    }
    children.push_back(pid);
  }
  // Read while they write: every read is a whole version of one writer or (before the first rename) no file.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  int whole_reads = 0, running = kWriters;
  std::vector<int> exit_codes(kWriters, -1);
  while (running > 0) {
    if (fs::exists(target)) {
      const std::string got = slurp(target);
      if (!got.empty()) {
        const int k = got[0] - 'A';
        ASSERT_TRUE(k >= 0 && k < kWriters && got == version_of(k)) << "torn file: " << got.size() << " bytes";
        ++whole_reads;
      }
    }
    for (int k = 0; k < kWriters; ++k) {
      int status = 0;
      if (exit_codes[k] < 0 && ::waitpid(children[k], &status, WNOHANG) == children[k]) {
        exit_codes[k] = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        --running;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (int k = 0; k < kWriters; ++k) {
        if (exit_codes[k] < 0) ::kill(children[k], SIGKILL), ::waitpid(children[k], nullptr, 0);
      }
      FAIL() << "the writers did not finish in 90 s";
    }
  }
  for (int k = 0; k < kWriters; ++k) EXPECT_EQ(exit_codes[k], 0) << "writer " << k << " failed";
  EXPECT_GT(whole_reads, 0) << "the reader never saw the file: the check ran on nothing";
  const std::string final_bytes = slurp(target);
  ASSERT_FALSE(final_bytes.empty());
  EXPECT_TRUE(final_bytes == version_of(final_bytes[0] - 'A'));
  EXPECT_TRUE(temporaries_of(target).empty()) << "a temporary was left behind";
  fs::remove(target);
}

TEST(AtomicFile, TemporaryNamesAreUniquePerCall) {
  const std::string target = temp_path("atomic_names");
  fsdp::util::AtomicFile a(target), b(target);
  EXPECT_NE(a.temp_path(), b.temp_path());
  EXPECT_NE(a.temp_path().find("." + std::to_string(::getpid()) + "."), std::string::npos) << a.temp_path();
  EXPECT_EQ(temporaries_of(target).size(), 2u);
}

TEST(AtomicFile, FailureMidWriteKeepsTheOldFileAndNoTemporary) {
  const std::string target = temp_path("atomic_failure");
  fsdp::util::write_file_atomic(target, "old contents", fsdp::util::DirSync::Yes, "test");
  ASSERT_EQ(slurp(target), "old contents");
  // A throw between writes (what a failing tensor producer or a full disk does to a writer).
  try {
    fsdp::util::AtomicFile file(target, "test");
    file.write("new, but only half");
    ASSERT_EQ(temporaries_of(target).size(), 1u) << "the bytes did not go to a temporary";
    throw std::runtime_error("producer failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(slurp(target), "old contents");
  EXPECT_TRUE(temporaries_of(target).empty());
  // Never committed: same.
  { fsdp::util::AtomicFile file(target, "test"); file.write("abandoned"); }
  EXPECT_EQ(slurp(target), "old contents");
  EXPECT_TRUE(temporaries_of(target).empty());
  fs::remove(target);

  // The rename itself fails (the target is a non-empty directory): one error naming both, no temporary left.
  const std::string dir_target = temp_path("atomic_failure_dir");
  fs::create_directories(dir_target + "/inside");
  try {
    fsdp::util::write_file_atomic(dir_target, "x", fsdp::util::DirSync::No, "test");
    ADD_FAILURE() << "renaming over a non-empty directory succeeded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("test: cannot rename"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_TRUE(fs::is_directory(dir_target + "/inside"));
  EXPECT_TRUE(temporaries_of(dir_target).empty());
  fs::remove(dir_target + "/inside");
  fs::remove(dir_target);
}
