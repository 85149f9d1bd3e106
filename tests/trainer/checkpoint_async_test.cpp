// fsdp-train checkpoints on one process: an async save that fails in the background raises at the next
// checkpoint call (never silently); keep_latest_k keeps the newest; load_step and exclude_from_loading.
#include "config.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {
JobConfig tiny(const std::string& name, int64_t steps) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "4", "--training.steps", std::to_string(steps),
                             "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1"});
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_ckpt_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(c.job.dump_folder);
  c.checkpoint.enable = true;
  c.checkpoint.interval = 2;
  return c;
}
TrainEnv quiet() {
  TrainEnv env;
  env.verbose = false;
  return env;
}
}  // namespace

TEST(TrainerCheckpoint, BackgroundSaveErrorSurfacesAtTheNextCheckpointCall) {
  JobConfig c = tiny("async_error", 4);
  c.checkpoint.async_mode = "async";
  // The checkpoint folder cannot be created: a regular file is in the way.
  fs::create_directories(c.job.dump_folder);
  std::ofstream(fs::path(c.job.dump_folder) / "checkpoint") << "not a directory";
  try {
    run_training(c, quiet(), false);
    FAIL() << "a failed background save went unnoticed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("step-2"), std::string::npos) << e.what();
  }
}

TEST(TrainerCheckpoint, KeepLatestKAndLoadStep) {
  JobConfig c = tiny("keep", 8);
  c.checkpoint.keep_latest_k = 2;
  c.checkpoint.last_save_model_only = false;
  const TrainSummary full = run_training(c, quiet(), false);
  const std::string folder = c.job.dump_folder + "/checkpoint";
  EXPECT_EQ(fsdp::checkpoint::complete_steps(folder), (std::vector<int64_t>{6, 8}));
  // load_step = 6: the run resumes after step 6 and repeats steps 7 and 8 exactly.
  c.checkpoint.load_step = 6;
  const TrainSummary again = run_training(c, quiet(), false);
  ASSERT_EQ(again.losses.size(), 2u);
  EXPECT_EQ(again.losses[0], full.losses[6]);
  EXPECT_EQ(again.losses[1], full.losses[7]);
  // Excluding the optimizer and the train state: the model is loaded, training restarts at step 1.
  c.checkpoint.exclude_from_loading = {"optimizer", "train_state", "lr_scheduler", "dataloader"};
  const TrainSummary fresh = run_training(c, quiet(), false);
  EXPECT_EQ(fresh.losses.size(), 8u);
  EXPECT_LT(fresh.losses[0], full.losses[0] - 0.1);  // started from the trained weights
}
