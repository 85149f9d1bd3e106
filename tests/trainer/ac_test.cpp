// fsdp-train with [activation_checkpoint] on 2 ranks (FSDP): the loss curve with full, layer-selective (every 2nd
// block) and op-level selective checkpointing equals the run without it, and the recomputation really ran.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <filesystem>

using namespace fsdp_train;

namespace {

TrainSummary train(const std::string& mode, const std::string& option) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "4", "--training.steps", "3", "--lr_scheduler.warmup_steps",
                             "1", "--metrics.peak_tflops", "1", "--activation_checkpoint.mode", mode,
                             "--activation_checkpoint.selective_ac_option", option});
  // One folder for all ranks: the launch check requires the same effective configuration on every rank.
  c.job.dump_folder = test::shared_dir("fsdp_train_ac", mode + option);
  return run_training(c, test::world_env(), false);
}
}  // namespace

TEST(TrainerActivationCheckpoint, LossEqualsRunWithout) {
  const TrainSummary ref = train("none", "2");
  EXPECT_EQ(ref.ac_forwards, 0);
  EXPECT_NE(ref.plan.find("no activation checkpointing"), std::string::npos) << ref.plan;
  struct Case {
    const char* mode;
    const char* option;
    const char* plan;
  };
  for (const Case& c : {Case{"full", "2", "full activation checkpointing"},
                        Case{"selective", "2", "layer-selective activation checkpointing (every 2 blocks"},
                        Case{"selective", "op", "op-level selective activation checkpointing"}}) {
    SCOPED_TRACE(std::string(c.mode) + " " + c.option);
    const TrainSummary got = train(c.mode, c.option);
    EXPECT_NE(got.plan.find(c.plan), std::string::npos) << got.plan;
    EXPECT_GT(got.ac_recomputes, 0);
    EXPECT_EQ(got.ac_recomputes, got.ac_forwards);
    if (std::string(c.option) == "op" && std::string(c.mode) == "selective") EXPECT_GT(got.ac_mm_reused, 0);
    ASSERT_EQ(ref.losses.size(), got.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-6 * ref.losses[i]) << "step " << i + 1;
      EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-6 * ref.grad_norms[i]) << "step " << i + 1;
    }
    EXPECT_LT(got.losses.back(), got.losses.front());
  }
}
