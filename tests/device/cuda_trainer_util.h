#pragma once
// What the fsdp-train device tests share: a small job, its single-process CPU reference (plain training of the
// whole global batch, no process group: fully_shard, the pipeline and expert parallelism play no part in it), and
// this rank's TrainEnv on the device world.
#include "device/device_util.h"

#include "config.h"
#include "trainer.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

namespace fsdp_device {

// `steps` steps of a global batch of 4 x 32 tokens (one sample per rank and microbatch at 2 ranks), warmup 1.
inline fsdp_train::JobConfig trainer_job(const std::string& name, const std::vector<std::string>& extra, int64_t steps) {
  std::vector<std::string> args{"--training.seq_len", "32", "--training.local_batch_size", "2",
                                "--training.global_batch_size", "4", "--training.steps", std::to_string(steps),
                                "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
                                "--metrics.peak_tflops", "1"};
  // The default data (Debian's /usr/share/common-licenses); a GPU machine without it trains on the repository's docs.
  if (!std::filesystem::exists("/usr/share/common-licenses"))
    args.insert(args.end(), {"--training.dataset", "text", "--training.dataset_path", FSDP_SOURCE_DIR "/docs"});
  args.insert(args.end(), extra.begin(), extra.end());
  fsdp_train::JobConfig c = fsdp_train::load_config(args);
  // Each rank's own folder: the reference runs of every rank must not share files.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_device_trainer_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(c.job.dump_folder);
  return c;
}

// The job on the CPU in this process alone, fp32 (mixed precision applies to FSDP only, which a process without a
// group does not use).
inline fsdp_train::TrainSummary cpu_reference(fsdp_train::JobConfig c) {
  c.training.device = "cpu";
  c.job.dump_folder += "_ref";
  std::filesystem::remove_all(c.job.dump_folder);
  fsdp_train::TrainEnv single;
  single.verbose = false;
  return fsdp_train::run_training(c, single, false);
}

inline fsdp_train::TrainEnv device_env(const fsdp::ProcessGroupPtr& world) {
  fsdp_train::TrainEnv env;
  env.rank = world->rank();
  env.world_size = world->size();
  env.group = world;
  env.verbose = world->rank() == 0;
  return env;
}

}  // namespace fsdp_device
