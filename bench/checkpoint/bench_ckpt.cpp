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
#include <fsdp/util/timer.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>
#include <algorithm>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;
using Clock = fsdp::util::SteadyClock;

namespace {
// The disk benchmarks keep their state on the CPU: Gloo, also where "auto" would pick NCCL (a GPU machine).
fsdp::InitOptions cpu_world() {
  fsdp::InitOptions o;
  o.backend = "gloo";
  return o;
}

// `bytes` of memory aligned to 4096 (O_DIRECT's rule for buffers), as a byte tensor that owns it.
at::Tensor aligned_buffer(int64_t bytes) {
  at::Tensor raw = at::empty({bytes + 4096}, at::kByte);
  const auto addr = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const int64_t shift = static_cast<int64_t>((4096 - addr % 4096) % 4096);
  return raw.narrow(0, shift, bytes);
}

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

// The bench's data, a formula both sides compute the same way (float32 ops), so a load can be checked
// without the saving processes: full[r][c] = (r % 1000) + 0.25 * key_index + 1e-4 * c.
at::Tensor rows_of_key(int64_t key_index, int64_t row0, int64_t rows, int64_t cols) {
  const at::Tensor r = at::arange(row0, row0 + rows, at::kLong).remainder(1000).to(at::kFloat) + 0.25 * key_index;
  const at::Tensor c = at::arange(cols, at::kFloat) * 1e-4;
  return r.unsqueeze(1) + c.unsqueeze(0);
}

// Resharding load (run on M ranks): loads a checkpoint saved on 2 ranks into Shard(0) over this world, page
// cache dropped first, each rank's rows checked against the formula. Prints one JSON line on rank 0.
int reshard_load(const std::string& path, int read_threads) {
  auto world = fsdp::init_process_group(cpu_world());
  const int rank = world->rank(), n = world->size();
  auto mesh = fsdp::init_device_mesh("cpu", {n}, {"shard"});
  const ckpt::CheckpointSummary summary = ckpt::inspect(path);
  ckpt::StateDict dst;
  int64_t key_index = 0;  // the summary lists the tensors sorted by name, as the saving side numbered them
  std::map<std::string, int64_t> index;
  for (const auto& t : summary.tensors) {
    const int64_t rows = t.shape[0], cols = t.shape[1];
    TORCH_CHECK(rows % n == 0, "bench: ", rows, " rows do not split over ", n, " ranks");
    dst.tensors[t.name] = fsdp::ShardedTensor::from_local(at::empty({rows / n, cols}), mesh, {fsdp::Shard(0)}, {rows, cols});
    index[t.name] = key_index++;
  }
  if (rank == 0) drop_cache(path);
  world->barrier().wait();
  const auto t0 = Clock::now();
  ckpt::LoadOptions load_options;
  load_options.read_threads = read_threads;
  const auto res = ckpt::load(dst, path, load_options);
  world->barrier().wait();
  const double load_s = fsdp::util::seconds_since(t0);
  bool equal = true;
  for (const auto& [k, v] : dst.tensors) {
    equal = equal && at::equal(v.local(), rows_of_key(index.at(k), v.local_offset()[0], v.local().size(0), v.local().size(1)));
  }
  at::Tensor stats = at::tensor({static_cast<double>(res.bytes_read), equal ? 0.0 : 1.0});
  world->all_reduce(stats).wait();
  if (rank == 0) {
    std::printf("{\"side\": \"libfsdp\", \"reshard_load_ranks\": %d, \"read_threads\": %d, \"saved_on\": %lld, \"load_s\": %.3f, "
                "\"bytes_read\": %.0f, \"state_bytes\": %lld, \"equal\": %s}\n",
                n, read_threads, static_cast<long long>(summary.world_size), load_s, stats[0].item<double>(),
                static_cast<long long>(summary.total_bytes), stats[1].item<double>() == 0 ? "true" : "false");
    std::fflush(stdout);
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return equal ? 0 : 1;
}

// The async save's stall inside training: a model of the same size (`layers` bias-free Linear(cols, cols),
// each fully_shard'ed, AdamW) trains on `device`; the step time is the median of plain steps, and for each
// configuration a saver makes two saves of the trainer state (model + optimizer state dicts) while training
// goes on — the first allocates its staging buffers, the second reuses them.
struct StallConfig {
  std::string name;
  ckpt::AsyncMode mode;
  ckpt::Staging staging;
};
struct Trial {
  double blocked_s = 0, extra_s = 0, save_total_s = 0;
  int steps = 0;
};
struct Stall {
  double step_s = 0;
  std::vector<double> plain;  // sorted
  std::vector<std::pair<std::string, Trial>> trials;
  // "train_step_s": .., "train_steps_s": [..], "name": {...}, ... (first saves as name_first)
  std::string json() const {
    std::string out = "\"train_step_s\": " + std::to_string(step_s) + ", \"train_steps_s\": [";
    for (size_t i = 0; i < plain.size(); ++i) out += (i ? ", " : "") + std::to_string(plain[i]);
    out += "]";
    for (const auto& [name, t] : trials) {
      out += ", \"" + name + "\": {\"blocked_s\": " + std::to_string(t.blocked_s) +
             ", \"extra_s\": " + std::to_string(t.extra_s) + ", \"steps\": " + std::to_string(t.steps) +
             ", \"save_total_s\": " + std::to_string(t.save_total_s) + ", \"blocked_fraction\": " +
             std::to_string(t.blocked_s / step_s) + ", \"stall_fraction\": " +
             std::to_string((t.blocked_s + t.extra_s) / step_s) + "}";
    }
    return out;
  }
};

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

Stall measure_stall(const fsdp::ProcessGroupPtr& world, const fsdp::DeviceMesh& mesh, int64_t cols, int64_t layers,
                    const fs::path& root, const torch::Device& device, const std::vector<StallConfig>& configs) {
  const int n = world->size();
  torch::manual_seed(0);
  fsdp::nn::Sequential model;
  for (int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(torch::nn::LinearOptions(cols, cols).bias(false)));
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;  // fully_shard moves the model to the mesh's device
  for (size_t i = 0; i < model->size(); ++i) fsdp::fully_shard(model->ptr(i), opts);
  fsdp::fully_shard(model.ptr(), opts);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const at::Tensor x = (at::randn({16, cols}) * 0.01).to(device);
  ckpt::AsyncSaver* staging_saver = nullptr;  // background staging: wait for the snapshot before the step
  double blocked_in_step = 0;                 // the training thread's wait_staged() time in the last step
  auto step = [&] {
    world->barrier().wait();
    const auto s0 = Clock::now();
    optim.zero_grad();
    fsdp::nn::call(model, x).square().mean().backward();
    blocked_in_step = staging_saver ? staging_saver->wait_staged() : 0;
    optim.step();
    synchronize(device);  // the step's kernels done, not only queued
    world->barrier().wait();
    return fsdp::util::seconds_since(s0);
  };
  step();  // optimizer state allocated
  Stall out;
  for (int i = 0; i < 5; ++i) out.plain.push_back(step());
  std::sort(out.plain.begin(), out.plain.end());
  out.step_s = out.plain[2];
  std::vector<int> all_ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all_ranks[static_cast<size_t>(r)] = r;
  auto save_group = fsdp::new_group(all_ranks, "checkpoint");
  auto train_state = [&] {
    auto sd = ckpt::model_state_dict(*model);
    sd.merge(ckpt::optimizer_state_dict(*model, optim));
    return sd;
  };
  // One async save of the trainer state while training goes on: the time the training thread is blocked in
  // checkpoint calls (save(); wait_staged() before the optimizer step), and the extra wall time of the steps
  // that run while the save is in flight (the background copy and write competing for the cores), over the
  // plain step. Steps continue until the save is done on every rank (at most 12).
  int save_no = 0;
  auto trial = [&](ckpt::AsyncSaver& saver) {
    Trial t;
    world->barrier().wait();
    const auto t0 = Clock::now();
    staging_saver = &saver;
    t.blocked_s = saver.save(train_state(), (root / ("async-" + std::to_string(++save_no))).string()).stage_seconds;
    for (;;) {
      t.extra_s += step() - out.step_s;
      t.blocked_s += blocked_in_step;
      ++t.steps;
      at::Tensor busy = at::full({1}, saver.in_flight() ? 1.0 : 0.0).to(world->device());
      world->all_reduce(busy, fsdp::ReduceOp::Max).wait();
      if (busy.item<double>() == 0 || t.steps == 12) break;
    }
    staging_saver = nullptr;
    saver.wait();
    world->barrier().wait();
    t.save_total_s = fsdp::util::seconds_since(t0);
    return t;
  };
  for (const StallConfig& c : configs) {
    ckpt::AsyncSaverOptions o;  // defaults otherwise: buffers reused, the write at nice 19
    o.mode = c.mode;
    o.staging = c.staging;
    ckpt::AsyncSaver saver(save_group, o);
    out.trials.emplace_back(c.name + "_first", trial(saver));
    out.trials.emplace_back(c.name, trial(saver));
  }
  return out;
}

// --device cuda:0 / --stall-only: only the stall, with the model on `device` (on CUDA with Gloo, every rank on
// that one GPU), for TorchTitan's three async modes' staging: pageable and pinned blocking snapshots, and the
// pinned snapshot taken in the background (device-to-host copies on a side stream during forward/backward).
int stall_bench(double gb, const std::string& dir, const std::string& device_name) {
  const torch::Device device(device_name);
  fsdp::InitOptions init;
  init.backend = "gloo";  // the ranks share one GPU, which NCCL refuses ("Duplicate GPU detected")
  if (!device.is_cpu()) init.device = device_name;
  auto world = fsdp::init_process_group(init);
  const int rank = world->rank(), n = world->size();
  auto mesh = fsdp::init_device_mesh(device.is_cpu() ? "cpu" : c10::DeviceTypeName(device.type(), true), {n}, {"shard"});
  const int64_t cols = 4096, layers = std::max<int64_t>(1, static_cast<int64_t>(gb * 1e9 / 4 / cols / cols));
  const fs::path root = fs::path(dir) / "ours-stall";
  if (rank == 0) fs::remove_all(root), fs::create_directories(root);
  world->barrier().wait();
  const Stall stall = measure_stall(world, mesh, cols, layers, root, device,
                                    {{"titan_async", ckpt::AsyncMode::Async, ckpt::Staging::Blocking},
                                     {"titan_async_pinned", ckpt::AsyncMode::AsyncWithPinnedMem, ckpt::Staging::Blocking},
                                     {"background_pinned", ckpt::AsyncMode::AsyncWithPinnedMem, ckpt::Staging::Background}});
  if (rank == 0) {
    std::printf("{\"side\": \"libfsdp\", \"ranks\": %d, \"device\": \"%s\", \"model_gb\": %.3f, %s}\n", n,
                device_name.c_str(), static_cast<double>(layers * cols * cols * 4) / 1e9, stall.json().c_str());
    std::fflush(stdout);
    fs::remove_all(root);
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  double gb = 0.5;
  std::string dir = "/tmp/fsdp_ckpt_bench", reshard_from;
  std::string device = "cpu";  // --device cuda:0: the training part on the GPU (Gloo on CUDA, ranks share it)
  bool keep = false, stall_only = false, no_stall = false;
  int read_threads = ckpt::LoadOptions{}.read_threads;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--keep") keep = true;
    else if (a == "--stall-only") stall_only = true;
    else if (a == "--no-stall") no_stall = true;  // save and load only (quick runs)
    else if (i + 1 < argc && a == "--device") device = argv[++i];
    else if (i + 1 < argc && a == "--gb") gb = std::stod(argv[++i]);
    else if (i + 1 < argc && a == "--dir") dir = argv[++i];
    else if (i + 1 < argc && a == "--reshard-from") reshard_from = argv[++i];
    else if (i + 1 < argc && a == "--read-threads") read_threads = std::stoi(argv[++i]);
  }
  if (!reshard_from.empty()) return reshard_load(reshard_from, read_threads);
  if (stall_only || device != "cpu") return stall_bench(gb, dir, device);
  auto world = fsdp::init_process_group(cpu_world());
  const int rank = world->rank(), n = world->size();
  auto mesh = fsdp::init_device_mesh("cpu", {n}, {"shard"});
  const int64_t cols = 4096, tensors = 16;
  // Divisible by 12: the resharding loads split the rows evenly over 3 and 4 ranks.
  const int64_t rows = static_cast<int64_t>(gb * 1e9 / 4 / cols / tensors) / 12 * 12;
  std::map<std::string, int64_t> keys;  // name -> its index in sorted order (the data formula's key_index)
  for (int64_t i = 0; i < tensors; ++i) {
    const std::string fqn = "layers." + std::to_string(i) + ".weight";
    for (const std::string& key : {fqn, "optimizer.state." + fqn + ".exp_avg", "optimizer.state." + fqn + ".exp_avg_sq"})
      keys[key] = 0;
  }
  int64_t next_index = 0;
  for (auto& [key, index] : keys) index = next_index++;
  ckpt::StateDict sd;
  int64_t local_bytes = 0;
  for (const auto& [key, index] : keys) {
    at::Tensor local = rows_of_key(index, rank * (rows / n), rows / n, cols);
    local_bytes += local.numel() * 4;
    sd.tensors[key] = fsdp::ShardedTensor::from_local(local, mesh, {fsdp::Shard(0)}, {rows, cols});
  }
  const double total_gb = static_cast<double>(local_bytes) * n / 1e9;
  const fs::path root = fs::path(dir) / "ours";
  if (rank == 0) fs::remove_all(root), fs::create_directories(root);
  world->barrier().wait();

  // Raw disk: the same bytes per rank, one sequential file, write + fsync; then read back. Twice: buffered
  // (write(), then pread) and direct (O_DIRECT in 64 MiB aligned blocks, the data copied through an aligned
  // buffer as dd does). The faster of the two is this disk's raw bandwidth; our saves write direct by default.
  const fs::path raw = root / ("raw-" + std::to_string(rank) + ".bin");
  std::vector<const at::Tensor*> locals;
  for (auto& [k, v] : sd.tensors) locals.push_back(&v.local());
  // Wall time of f() on all ranks together: a barrier before and after, so the slowest rank counts.
  auto timed = [&](auto&& f) {
    world->barrier().wait();
    const auto t = Clock::now();
    f();
    world->barrier().wait();
    return fsdp::util::seconds_since(t);
  };
  auto raw_write = [&](bool direct) {
    return timed([&] {
      int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
      TORCH_CHECK(fd >= 0, "raw write: cannot open ", raw.string(), ": ", std::strerror(errno));
      if (direct) {
        const int64_t block = int64_t{64} << 20;
        at::Tensor buf = aligned_buffer(block);
        char* b = static_cast<char*>(buf.data_ptr());
        int64_t filled = 0, off = 0;
        auto flush = [&](int64_t n) {
          TORCH_CHECK(::pwrite(fd, b, static_cast<size_t>(n), off) == n, "raw direct write failed: ",
                      std::strerror(errno));
          off += n, filled = 0;
        };
        for (const at::Tensor* t : locals) {
          const char* p = static_cast<const char*>(t->data_ptr());
          int64_t left = t->numel() * 4;
          while (left > 0) {
            const int64_t take = std::min(left, block - filled);
            std::memcpy(b + filled, p, static_cast<size_t>(take));
            filled += take, p += take, left -= take;
            if (filled == block) flush(block);
          }
        }
        const int64_t real = off + filled;
        if (filled > 0) flush((filled + 4095) / 4096 * 4096);
        TORCH_CHECK(::ftruncate(fd, real) == 0, "raw write: ftruncate failed");
      } else {
        for (const at::Tensor* t : locals) {
          const char* p = static_cast<const char*>(t->data_ptr());
          int64_t left = t->numel() * 4;
          while (left > 0) {
            const ssize_t w = ::write(fd, p, static_cast<size_t>(std::min<int64_t>(left, 1 << 30)));
            TORCH_CHECK(w > 0, "raw write failed: ", std::strerror(errno));
            p += w, left -= w;
          }
        }
      }
      ::fsync(fd);
      ::close(fd);
    });
  };
  auto raw_read = [&](bool direct) {
    drop_cache(root);
    return timed([&] {
      int fd = ::open(raw.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
      TORCH_CHECK(fd >= 0, "raw read: cannot open ", raw.string(), ": ", std::strerror(errno));
      const int64_t block = int64_t{64} << 20;
      at::Tensor buf = direct ? aligned_buffer(block) : at::Tensor();
      const char* b = direct ? static_cast<const char*>(buf.data_ptr()) : nullptr;
      int64_t off = 0;                      // file offset of the next byte to hand out
      int64_t block_at = 0, block_len = 0;  // direct: the file's bytes [block_at, block_at + block_len) are in buf
      for (const at::Tensor* t : locals) {
        at::Tensor dst = at::empty_like(*t);
        char* p = static_cast<char*>(dst.data_ptr());
        int64_t left = dst.numel() * 4;
        while (left > 0) {
          if (direct) {  // the file in 64 MiB aligned blocks read in order, copied out (as dd does)
            if (off >= block_at + block_len) {
              block_at = off;
              const ssize_t r = ::pread(fd, buf.data_ptr(), static_cast<size_t>(block), block_at);
              TORCH_CHECK(r > 0, "raw direct read failed at ", block_at, ": ", std::strerror(errno));
              block_len = r;
            }
            const int64_t take = std::min(left, block_at + block_len - off);
            std::memcpy(p, b + (off - block_at), static_cast<size_t>(take));
            p += take, left -= take, off += take;
          } else {
            const ssize_t r = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(left, 1 << 30)), off);
            TORCH_CHECK(r > 0, "raw read failed: ", std::strerror(errno));
            p += r, left -= r, off += r;
          }
        }
      }
      ::close(fd);
    });
  };
  const double raw_write_buffered = raw_write(false);
  const double raw_read_buffered = raw_read(false);
  const double raw_write_direct = raw_write(true);
  const double raw_read_direct = raw_read(true);
  fs::remove(raw);

  // Ours: save buffered (SaveOptions::direct_io = false), then as by default (direct); load the latter (cold,
  // then warm), then the former (cold: whether files written direct read back slower or faster).
  ckpt::SaveOptions buffered;
  buffered.direct_io = false;
  const double save_buffered_s = timed([&] { ckpt::save(sd, (root / "step-0").string(), buffered); });
  ::sync();
  const double save_s = timed([&] { ckpt::save(sd, (root / "step-1").string()); });
  ckpt::StateDict dst;
  for (const auto& [k, v] : sd.tensors)
    dst.tensors[k] = fsdp::ShardedTensor::from_local(at::empty_like(v.local()), v.mesh(), v.placements(), v.sizes());
  // One timed load of `step` into `dst` (zeroed first), checked against what was saved.
  bool equal = true;
  auto timed_load = [&](const char* step, bool cold) {
    for (auto& [k, v] : dst.tensors) v.local().zero_();
    if (cold) drop_cache(root);
    const double seconds = timed([&] { ckpt::load(dst, (root / step).string()); });
    for (const auto& [k, v] : sd.tensors) equal = equal && at::equal(v.local(), dst.tensors.at(k).local());
    return seconds;
  };
  const double load_s = timed_load("step-1", /*cold=*/true);
  // Warm: the files in the page cache (a restart on the same host right after the save): the software's cost.
  const double warm_load_s = timed_load("step-1", /*cold=*/false);
  const double load_buffered_saved_s = timed_load("step-0", /*cold=*/true);
  if (rank == 0) fs::remove_all(root / "step-0");

  // Async stall: the CPU snapshot the trainer takes before writing in the background.
  const auto t0 = Clock::now();
  int64_t snap_bytes = 0;
  for (const auto& [k, v] : sd.tensors) snap_bytes += v.local().clone().numel() * 4;
  const double snapshot_s = fsdp::util::seconds_since(t0);
  sd = {};
  dst = {};

  // A real training step of a model of the same size, and the async save's stall inside it.
  Stall stall;
  if (!no_stall) {
    stall = measure_stall(world, mesh, cols, tensors, root, torch::Device("cpu"),
                          {{"titan_async", ckpt::AsyncMode::Async, ckpt::Staging::Blocking},
                           {"background", ckpt::AsyncMode::Async, ckpt::Staging::Background}});
  }
  if (rank == 0) {
    std::printf("{\"side\": \"libfsdp\", \"ranks\": %d, \"state_gb\": %.3f, \"raw_write_s\": %.3f, \"raw_read_s\": %.3f, "
                "\"raw_direct_write_s\": %.3f, \"raw_direct_read_s\": %.3f, \"save_buffered_s\": %.3f, "
                "\"save_s\": %.3f, \"load_s\": %.3f, \"load_of_buffered_save_s\": %.3f, \"warm_load_s\": %.3f, \"snapshot_s\": %.3f, \"equal\": %s%s%s}\n",
                n, total_gb, raw_write_buffered, raw_read_buffered, raw_write_direct, raw_read_direct, save_buffered_s,
                save_s, load_s, load_buffered_saved_s, warm_load_s, snapshot_s, equal ? "true" : "false", no_stall ? "" : ", ",
                no_stall ? "" : stall.json().c_str());
    std::fflush(stdout);
  }
  if (rank == 0) {
    // --keep: leave step-1 for the resharding loads (bench/checkpoint/run.sh removes it afterwards).
    for (const auto& e : fs::directory_iterator(root)) {
      if (!keep || e.path().filename() != "step-1") fs::remove_all(e.path());
    }
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return equal ? 0 : 1;
}
