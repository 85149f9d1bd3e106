// Multi-process parity (run under fsdprun with W = 2 or 4 ranks): the loss curve of W data-parallel ranks
// (accumulation 4 / W) equals that of 1 rank with gradient accumulation 4 over the same global batches, to 1e-5
// (relative). The 1-rank reference runs inside each process without any process group.
#include "config.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <filesystem>

using namespace fsdp_train;

namespace {


JobConfig base(const std::string& name, int64_t replicate, int64_t shard) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "8", "--training.steps", "8", "--lr_scheduler.warmup_steps",
                             "2", "--metrics.peak_tflops", "1"});
  c.parallelism.data_parallel_replicate_degree = replicate;
  c.parallelism.data_parallel_shard_degree = shard;
  // Distributed runs share one folder (the launch check requires the same effective configuration on every
  // rank); the 1-rank references, run by every process, get one each.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_parity_" + name;
  const bool per_rank = name.size() > 4 && name.compare(name.size() - 4, 4, "_ref") == 0;
  if (per_rank) c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (per_rank || fsdp::world()->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);  // one remover
  fsdp::world()->barrier().wait();
  return c;
}

void expect_parity(int64_t replicate, int64_t shard, const std::string& name, const std::string& plan) {
  auto world = fsdp::world();
  const int64_t shard_size = shard == -1 ? world->size() / replicate : shard;
  if (replicate * shard_size != world->size()) GTEST_SKIP() << "needs replicate x shard = world size " << world->size();
  TrainEnv single;
  single.verbose = false;
  const TrainSummary ref = run_training(base(name + "_ref", 1, -1), single, false);  // 1 rank, accumulation 4
  TrainEnv dist;
  dist.rank = world->rank();
  dist.world_size = world->size();
  dist.group = world;
  dist.verbose = false;
  const TrainSummary got = run_training(base(name, replicate, shard), dist, false);  // W ranks, accumulation 4 / W
  EXPECT_NE(got.plan.find(plan), std::string::npos) << got.plan;  // the intended parallelisation was applied
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "step " << i + 1;
  }
  EXPECT_LT(got.losses.back(), got.losses.front());
}

}  // namespace

TEST(TrainerParity, ReplicateMatchesOneRankWithAccumulation) {
  expect_parity(fsdp::world()->size(), 1, "ddp", "data parallel (replicate");
}

TEST(TrainerParity, ShardMatchesOneRankWithAccumulation) { expect_parity(1, -1, "fsdp", "FSDP mesh"); }

TEST(TrainerParity, HsdpMatchesOneRankWithAccumulation) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "HSDP 2 x 2 needs 4 ranks";
  expect_parity(2, 2, "hsdp", "HSDP mesh");
}
