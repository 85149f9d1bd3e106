// Checkpoint benchmark, our side (run under fsdprun, 2 ranks): the trainer state of a model of --gb GB fp32
// with AdamW (parameters + exp_avg + exp_avg_sq = 3x), sharded Shard(0) over the ranks. Measures, in one run:
// the disk's raw sequential write (write + fsync) and read (pread) of the same bytes per rank, our save and our
// load (page cache dropped for the files with posix_fadvise before every read), and the async-save stall (the
// CPU snapshot). Prints one JSON line on rank 0. bench/checkpoint/run.sh runs it next to PyTorch DCP.
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void drop_cache(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}
}  // namespace

int main(int argc, char** argv) {
  double gb = 0.5;
  std::string dir = "/tmp/fsdp_ckpt_bench";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--gb") gb = std::stod(argv[i + 1]);
    if (std::string(argv[i]) == "--dir") dir = argv[i + 1];
  }
  auto world = fsdp::init_process_group();
  const int rank = world->rank(), n = world->size();
  auto mesh = fsdp::init_device_mesh("cpu", {n}, {"shard"});
  const int64_t cols = 4096, tensors = 16;
  const int64_t rows = static_cast<int64_t>(gb * 1e9 / 4 / cols / tensors) / n * n;
  ckpt::StateDict sd;
  int64_t local_bytes = 0;
  for (int64_t i = 0; i < tensors; ++i) {
    const std::string fqn = "layers." + std::to_string(i) + ".weight";
    for (const std::string& key : {fqn, "optimizer.state." + fqn + ".exp_avg", "optimizer.state." + fqn + ".exp_avg_sq"}) {
      at::Tensor local = at::randn({rows / n, cols});
      local_bytes += local.numel() * 4;
      sd.tensors[key] = fsdp::ShardedTensor::from_local(local, mesh, {fsdp::Shard(0)}, {rows, cols});
    }
  }
  const double total_gb = static_cast<double>(local_bytes) * n / 1e9;
  const fs::path root = fs::path(dir) / "ours";
  if (rank == 0) fs::remove_all(root), fs::create_directories(root);
  world->barrier().wait();

  // Raw disk: the same bytes per rank, one sequential file, write + fsync; then pread back.
  const fs::path raw = root / ("raw-" + std::to_string(rank) + ".bin");
  world->barrier().wait();
  auto t0 = Clock::now();
  {
    int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (auto& [k, v] : sd.tensors) {
      const char* p = static_cast<const char*>(v.local().data_ptr());
      int64_t left = v.local().numel() * 4;
      while (left > 0) {
        ssize_t w = ::write(fd, p, static_cast<size_t>(std::min<int64_t>(left, 1 << 30)));
        p += w, left -= w;
      }
    }
    ::fsync(fd);
    ::close(fd);
  }
  world->barrier().wait();
  const double raw_write = since(t0);
  drop_cache(root);
  world->barrier().wait();
  t0 = Clock::now();
  {
    int fd = ::open(raw.c_str(), O_RDONLY);
    int64_t off = 0;
    for (auto& [k, v] : sd.tensors) {
      at::Tensor dst = at::empty_like(v.local());
      char* p = static_cast<char*>(dst.data_ptr());
      int64_t left = dst.numel() * 4;
      while (left > 0) {
        ssize_t r = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(left, 1 << 30)), off);
        p += r, left -= r, off += r;
      }
    }
    ::close(fd);
  }
  world->barrier().wait();
  const double raw_read = since(t0);
  fs::remove(raw);

  // Ours: save, then load into other tensors.
  world->barrier().wait();
  t0 = Clock::now();
  ckpt::save(sd, (root / "step-1").string());
  world->barrier().wait();
  const double save_s = since(t0);
  drop_cache(root);
  ckpt::StateDict dst;
  for (const auto& [k, v] : sd.tensors)
    dst.tensors[k] = fsdp::ShardedTensor::from_local(at::empty_like(v.local()), v.mesh(), v.placements(), v.sizes());
  world->barrier().wait();
  t0 = Clock::now();
  ckpt::load(dst, (root / "step-1").string());
  world->barrier().wait();
  const double load_s = since(t0);
  bool equal = true;
  for (const auto& [k, v] : sd.tensors) equal = equal && at::equal(v.local(), dst.tensors.at(k).local());

  // Async stall: the CPU snapshot the trainer takes before writing in the background.
  t0 = Clock::now();
  int64_t snap_bytes = 0;
  for (const auto& [k, v] : sd.tensors) snap_bytes += v.local().clone().numel() * 4;
  const double snapshot_s = since(t0);

  if (rank == 0) {
    std::printf("{\"side\": \"libfsdp\", \"ranks\": %d, \"state_gb\": %.3f, \"raw_write_s\": %.3f, \"raw_read_s\": %.3f, "
                "\"save_s\": %.3f, \"load_s\": %.3f, \"snapshot_s\": %.3f, \"equal\": %s}\n",
                n, total_gb, raw_write, raw_read, save_s, load_s, snapshot_s, equal ? "true" : "false");
    std::fflush(stdout);
    fs::remove_all(root);
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return equal ? 0 : 1;
}
