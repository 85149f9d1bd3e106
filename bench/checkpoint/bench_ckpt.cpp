// Checkpoint benchmark, our side (run under fsdprun, 2 ranks): the trainer state of a model of --gb GB fp32
// with AdamW (parameters + exp_avg + exp_avg_sq = 3x), sharded Shard(0) over the ranks. Measures, in one run:
// the disk's raw sequential write (write + fsync) and read (pread) of the same bytes per rank, our save and our
// load (page cache dropped for the files with posix_fadvise before every read), and the async-save stall (the
// CPU snapshot). Prints one JSON line on rank 0. bench/checkpoint/run.sh runs it next to PyTorch DCP.
//
// The stall as a fraction of a step: a real model of the same size (16 bias-free Linear(4096, 4096) layers,
// 1.07 GB fp32, each fully_shard'ed, AdamW) trains on the same 2 ranks; the step time is the median of plain
// steps, and a step that starts an AsyncSaver save of its trainer state (model + optimizer state dicts) is
// timed with the snapshot (the stall) and while the background write runs.
#include <fsdp/checkpoint/async_save.h>
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/nn/sequential.h>
#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>
#include <algorithm>

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
  sd = {};
  dst = {};

  // A real training step of a model of the same size, and the async save's stall inside it.
  torch::manual_seed(0);
  fsdp::nn::Sequential model;
  for (int64_t i = 0; i < tensors; ++i) model->push_back(torch::nn::Linear(torch::nn::LinearOptions(cols, cols).bias(false)));
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  for (size_t i = 0; i < model->size(); ++i) fsdp::fully_shard(model->ptr(i), opts);
  fsdp::fully_shard(model.ptr(), opts);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const at::Tensor x = at::randn({16, cols}) * 0.01;
  ckpt::AsyncSaver* staging_saver = nullptr;  // background staging: wait for the snapshot before the step
  auto step = [&] {
    world->barrier().wait();
    const auto s0 = Clock::now();
    optim.zero_grad();
    fsdp::nn::call(model, x).square().mean().backward();
    if (staging_saver) staging_saver->wait_staged();
    optim.step();
    world->barrier().wait();
    return since(s0);
  };
  step();  // optimizer state allocated
  std::vector<double> plain;
  for (int i = 0; i < 3; ++i) plain.push_back(step());
  std::sort(plain.begin(), plain.end());
  const double step_s = plain[1];
  std::vector<int> all_ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all_ranks[static_cast<size_t>(r)] = r;
  auto save_group = fsdp::new_group(all_ranks, "checkpoint");
  auto train_state = [&] {
    auto sd = ckpt::model_state_dict(*model);
    sd.merge(ckpt::optimizer_state_dict(*model, optim));
    return sd;
  };
  // TorchTitan's async: the snapshot blocks the loop between two steps.
  double stall_s = 0, step_during_write_s = 0, async_total_s = 0, stage_s = 0;
  {
    ckpt::AsyncSaver saver(save_group, ckpt::AsyncMode::Async, ckpt::Staging::Blocking);
    world->barrier().wait();
    t0 = Clock::now();
    stage_s = saver.save(train_state(), (root / "step-2").string()).stage_seconds;
    world->barrier().wait();
    stall_s = since(t0);
    step_during_write_s = step();  // the background write competes for this machine's 2 cores
    saver.wait();
    world->barrier().wait();
    async_total_s = since(t0);
  }
  // Background staging: the snapshot runs during the next step's forward/backward; the loop waits for it only
  // before the optimizer step. The stall is the step's extra time over a plain step.
  double bg_start_s = 0, bg_step_s = 0;
  {
    ckpt::AsyncSaver saver(save_group, ckpt::AsyncMode::Async, ckpt::Staging::Background);
    staging_saver = &saver;
    world->barrier().wait();
    t0 = Clock::now();
    saver.save(train_state(), (root / "step-3").string());
    world->barrier().wait();
    bg_start_s = since(t0);
    bg_step_s = step();
    staging_saver = nullptr;
    saver.wait();
  }

  if (rank == 0) {
    std::printf("{\"side\": \"libfsdp\", \"ranks\": %d, \"state_gb\": %.3f, \"raw_write_s\": %.3f, \"raw_read_s\": %.3f, "
                "\"save_s\": %.3f, \"load_s\": %.3f, \"snapshot_s\": %.3f, \"equal\": %s, \"train_step_s\": %.3f, "
                "\"async_stall_s\": %.3f, \"async_snapshot_s\": %.3f, \"stall_fraction_of_step\": %.3f, "
                "\"step_during_background_write_s\": %.3f, \"async_save_total_s\": %.3f, "
                "\"bg_staging_start_s\": %.3f, \"bg_staging_step_s\": %.3f, \"bg_staging_stall_fraction\": %.3f}\n",
                n, total_gb, raw_write, raw_read, save_s, load_s, snapshot_s, equal ? "true" : "false", step_s,
                stall_s, stage_s, stall_s / step_s, step_during_write_s, async_total_s, bg_start_s, bg_step_s,
                (bg_start_s + bg_step_s - step_s) / step_s);
    std::fflush(stdout);
    fs::remove_all(root);
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return equal ? 0 : 1;
}
