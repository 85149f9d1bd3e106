// Checkpoints under pipeline parallelism (4 ranks): a pp 2 x dp_shard 2 run stopped after step 3 (right after its
// checkpoint) and resumed at the same layout equals the uninterrupted run bit for bit (losses, grad norms and the
// final weights); the same step-3 checkpoint loads at pp 1 x dp_shard 4 with the weights bit for bit (shown by
// resuming with a vanishing lr: the final save is the loaded weights) and trains on within 1e-6 of the uninterrupted run.
// The stages' checkpoints hold the whole model's FQNs, so another PP degree finds every key.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

std::string shared_dir(const std::string& name) { return test::shared_dir("fsdp_train_pp_resume", name); }

// Global batch 16 of 4 samples per rank: 2 accumulation steps at dp 2 (each a pipeline step of 4 microbatches),
// 1 at dp 4.
JobConfig job(const std::string& folder, int64_t pp) {
  JobConfig c = test::checkpointed_job(folder);
  c.training.local_batch_size = 4;
  c.training.global_batch_size = 16;
  c.parallelism.pipeline_parallel_degree = pp;
  c.parallelism.pipeline_parallel_schedule = PipelineSchedule::Interleaved1F1B;
  c.parallelism.pipeline_parallel_microbatch_size = 1;
  return c;
}

using test::model_tensors;

}  // namespace

TEST(TrainerPipelineResume, StoppedAndResumedEqualsUninterruptedAndLoadsAtAnotherDegree) {
  auto world = fsdp::world();
  if (world->size() != 4) GTEST_SKIP() << "pp 2 x dp_shard 2 needs 4 ranks";
  const std::string full_dir = shared_dir("full");
  const TrainSummary full = run_training(job(full_dir, 2), test::world_env(), false);
  ASSERT_EQ(full.losses.size(), 6u);
  ASSERT_NE(full.losses[3], full.losses[0]);  // it trains
  EXPECT_NE(full.plan.find("PP 2 (Interleaved1F1B, 4 stages"), std::string::npos) << full.plan;

  const std::string dir = shared_dir("stopped");
  const TrainSummary first = run_training(job(dir, 2), test::world_env(/*verbose=*/true, /*stop_after=*/3), false);
  ASSERT_EQ(first.losses.size(), 3u);
  world->barrier().wait();
  ASSERT_EQ(fsdp::checkpoint::complete_steps(dir + "/checkpoint"), std::vector<int64_t>{3});
  // Whole-model FQNs: every stage's parameters under their original names, once.
  const auto at3 = model_tensors(dir + "/checkpoint/step-3");
  EXPECT_TRUE(at3.count("tok_embeddings.weight") && at3.count("layers.0.attention.wq.weight") &&
              at3.count("layers.1.feed_forward.w2.weight") && at3.count("output.weight") && at3.count("norm.weight"));
  // A copy for the resume at another degree, before the same-degree resume adds step 6.
  const std::string other = shared_dir("dp4");
  if (world->rank() == 0) {
    fs::create_directories(other + "/checkpoint");
    fs::copy(dir + "/checkpoint/step-3", other + "/checkpoint/step-3", fs::copy_options::recursive);
  }
  world->barrier().wait();

  const TrainSummary resumed = run_training(job(dir, 2), test::world_env(), false);
  ASSERT_EQ(resumed.losses.size(), 3u);  // steps 4..6
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[i + 3]) << "step " << i + 4;  // bit for bit
    EXPECT_EQ(resumed.grad_norms[i], full.grad_norms[i + 3]) << "step " << i + 4;
  }
  world->barrier().wait();
  const auto want6 = model_tensors(full_dir + "/checkpoint/step-6");
  const auto got6 = model_tensors(dir + "/checkpoint/step-6");
  ASSERT_EQ(want6.size(), got6.size());
  for (const auto& [key, w] : want6) EXPECT_TRUE(torch::equal(got6.at(key), w)) << key;

  // pp 1 x dp_shard 4 from the pp 2 x dp_shard 2 checkpoint: trains on like the uninterrupted run (1e-6: another
  // reduction order) ...
  const TrainSummary at_dp4 = run_training(job(other, 1), test::world_env(), false);
  EXPECT_NE(at_dp4.plan.find("FSDP mesh"), std::string::npos) << at_dp4.plan;
  ASSERT_EQ(at_dp4.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(at_dp4.losses[i], full.losses[i + 3], 1e-6 * full.losses[i + 3]) << "step " << i + 4 << " at dp 4";
  }
  // ... and loads the weights bit for bit: resumed with lr 1e-30 (lr must be > 0), every AdamW update (at most
  // about lr x 10 in size, weight decay a factor 1 - 1e-31) is far below half an ulp of every weight, so the final
  // (model-only) save is exactly what it loaded.
  const std::string frozen = shared_dir("dp4_lr0");
  if (world->rank() == 0) {
    fs::create_directories(frozen + "/checkpoint");
    fs::copy(dir + "/checkpoint/step-3", frozen + "/checkpoint/step-3", fs::copy_options::recursive);
  }
  world->barrier().wait();
  JobConfig lr0 = job(frozen, 1);
  lr0.optimizer.lr = 1e-30;
  run_training(lr0, test::world_env(), false);
  world->barrier().wait();
  const auto loaded = model_tensors(frozen + "/checkpoint/step-6");
  ASSERT_EQ(loaded.size(), at3.size());
  for (const auto& [key, w] : at3) EXPECT_TRUE(torch::equal(loaded.at(key), w)) << key << " changed in the reload";
}
