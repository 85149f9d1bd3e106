// Multi-process parity (run under fsdprun with W = 2 or 4 ranks): the loss curve of W data-parallel ranks
// (accumulation 4 / W) equals that of 1 rank with gradient accumulation 4 over the same global batches, to 1e-5
// (relative). The 1-rank reference runs inside each process without any process group.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"
#include "expect_error.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

using namespace fsdp_train;

namespace {


JobConfig base(const std::string& name, int64_t replicate, int64_t shard, int64_t tp = 1, bool loss_parallel = true,
               bool validate = false) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "8", "--training.steps", "8", "--lr_scheduler.warmup_steps",
                             "2", "--metrics.peak_tflops", "1"});
  c.parallelism.data_parallel_replicate_degree = replicate;
  c.parallelism.data_parallel_shard_degree = shard;
  c.parallelism.tensor_parallel_degree = tp;
  c.parallelism.disable_loss_parallel = !loss_parallel;
  // [validation] at steps 1, 4 and 8 over the first 12 held-out samples: 6 batches of 2 samples on 1 rank;
  // expect_parity divides the batch count by the data-parallel degree (batch k covers samples [k*L*D, (k+1)*L*D)).
  c.validation.enable = validate;
  c.validation.freq = 4;
  c.validation.steps = 6;
  c.validation.local_batch_size = 2;
  c.validation.seq_len = 32;
  // Distributed runs share one folder (the launch check requires the same effective configuration on every
  // rank); the 1-rank references, run by every process, get one each.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_parity_" + name;
  const bool per_rank = name.size() > 4 && name.compare(name.size() - 4, 4, "_ref") == 0;
  if (per_rank) c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (per_rank || fsdp::world()->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);  // one remover
  fsdp::world()->barrier().wait();
  return c;
}

void expect_parity(int64_t replicate, int64_t shard, const std::string& name, const std::string& plan,
                   int64_t tp = 1, bool loss_parallel = true, bool validate = false) {
  auto world = fsdp::world();
  const int64_t shard_size = shard == -1 ? world->size() / replicate / tp : shard;
  if (replicate * shard_size * tp != world->size()) {
    GTEST_SKIP() << "needs replicate x shard x tp = world size " << world->size();
  }
  TrainEnv single;
  single.verbose = false;
  // 1 rank, accumulation 4
  const TrainSummary ref = run_training(base(name + "_ref", 1, -1, 1, true, validate), single, false);
  // W ranks, accumulation 4 / (W / tp)
  JobConfig config = base(name, replicate, shard, tp, loss_parallel, validate);
  config.validation.steps /= world->size() / tp;  // the same 12 held-out samples
  const TrainSummary got = run_training(config, test::world_env(), false);
  EXPECT_NE(got.plan.find(plan), std::string::npos) << got.plan;  // the intended parallelisation was applied
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "step " << i + 1;
  }
  EXPECT_LT(got.losses.back(), got.losses.front());
  // Validation (same held-out samples whatever the data-parallel degree) agrees too, and it ran and moved.
  ASSERT_EQ(got.validation_steps, ref.validation_steps);
  if (validate) {
    ASSERT_EQ(ref.validation_steps, (std::vector<int64_t>{1, 4, 8}));
    EXPECT_LT(ref.validation_losses.back(), ref.validation_losses.front());
  }
  for (size_t i = 0; i < ref.validation_losses.size(); ++i)
    EXPECT_NEAR(got.validation_losses[i], ref.validation_losses[i], 1e-5 * ref.validation_losses[i]) << "validation " << i;
}

}  // namespace

namespace {
// Pipeline parallelism through the trainer: pp x dp_shard x tp ranks against the 1-rank reference with gradient
// accumulation over the same global batches (loss and grad norm every step). local_batch_size 4 in 4
// microbatches of 1, so that every schedule has enough microbatches for its stages (cpu_tiny's 2 layers split
// into up to 4 stages: embedding | layer 0 | layer 1 | norm + output).
// `flavor`: cpu_tiny (2 layers: up to 4 stages) or debugmodel (6 layers: 8 stages, for the multi-stage schedules
// at pp 4).
// `schedule_csv`: run the schedule file instead (the names only label the runs).
void expect_pipeline_parity(int64_t pp, int64_t shard, int64_t tp, const std::vector<std::string>& schedules,
                            const std::string& flavor = "cpu_tiny", const std::string& schedule_csv = "") {
  auto world = fsdp::world();
  if (pp * shard * tp != world->size()) GTEST_SKIP() << "needs pp x shard x tp = world size " << world->size();
  TrainEnv single;
  single.verbose = false;
  // Validation at steps 1, 4 and 8 over 16 held-out samples (4 batches of 4 on 1 rank): under PP the
  // forward-only schedule, its batch split into the same 4 microbatches.
  JobConfig ref_config = base("pp_ref_" + flavor, 1, -1, 1, true, /*validate=*/true);
  ref_config.model.flavor = flavor;
  ref_config.validation.steps = 4;
  ref_config.validation.local_batch_size = 4;
  const TrainSummary ref = run_training(ref_config, single, false);
  ASSERT_EQ(ref.validation_steps, (std::vector<int64_t>{1, 4, 8}));
  EXPECT_LT(ref.validation_losses.back(), ref.validation_losses.front());
  for (const auto& schedule : schedules) {
    SCOPED_TRACE(schedule + " pp " + std::to_string(pp) + " x dp_shard " + std::to_string(shard) + " x tp " +
                 std::to_string(tp));
    const std::string name = "pp" + std::to_string(pp) + "_" + std::to_string(shard) + "_" + std::to_string(tp) + "_" +
                             schedule;
    JobConfig config = base(name + "_" + flavor, 1, shard, tp, true, /*validate=*/true);
    config.model.flavor = flavor;
    config.validation.local_batch_size = 4;
    config.validation.steps = 4 / shard;  // the same 16 held-out samples over the data-parallel ranks
    config.training.local_batch_size = 4;
    config.parallelism.pipeline_parallel_degree = pp;
    if (schedule_csv.empty()) {
      config.parallelism.pipeline_parallel_schedule = parse_choice<PipelineSchedule>(schedule).value();
    } else {
      config.parallelism.pipeline_parallel_schedule_csv = schedule_csv;
    }
    config.parallelism.pipeline_parallel_microbatch_size = 1;
    const TrainSummary got = run_training(config, test::world_env(), false);
    EXPECT_NE(got.plan.find("PP " + std::to_string(pp) + (schedule_csv.empty() ? " (" : " (CSV " + schedule_csv)),
              std::string::npos)
        << got.plan;
    ASSERT_EQ(ref.losses.size(), got.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
      EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-5 * ref.grad_norms[i]) << "step " << i + 1;
    }
    EXPECT_LT(got.losses.back(), got.losses.front());
    ASSERT_EQ(got.validation_steps, ref.validation_steps);
    for (size_t i = 0; i < ref.validation_losses.size(); ++i) {
      EXPECT_NEAR(got.validation_losses[i], ref.validation_losses[i], 1e-5 * ref.validation_losses[i])
          << "validation " << i;
    }
  }
}
}  // namespace

TEST(TrainerParity, PipelineMatchesOneRankWithAccumulation) {
  const int64_t n = fsdp::world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "pp = world on 2 or 4 ranks";
  // 4 stages need the multi-stage schedules at pp 2; at pp 4 one stage per rank.
  if (n == 2) {
    expect_pipeline_parity(2, 1, 1, {"GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble",
                                     "ZBVZeroBubble"});
  } else {
    expect_pipeline_parity(4, 1, 1, {"GPipe", "1F1B"});
    expect_pipeline_parity(4, 1, 1, {"LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"},
                           "debugmodel");
  }
}

// DualPipeV (overlapped forward-backward pairs, 2 stages per rank in a V) and a CSV schedule, pp 2 on 2 ranks, equal
// the 1-rank run with accumulation (loss, grad norm, validation; 1e-5). The CSV is a V-shaped GPipe no schedule
// name gives (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: the placement comes from the file). Dense model
// here (MoE under PP: moe_pipeline_test.cpp). A deadlocking CSV is refused before training with the cell.
TEST(TrainerParity, PipelineDualPipeVAndCsvScheduleMatchOneRankWithAccumulation) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "pp 2 on 2 ranks";
  expect_pipeline_parity(2, 1, 1, {"DualPipeV"});
  const std::string dir = ::testing::TempDir() + "/fsdp_train_parity_csv";
  std::filesystem::create_directories(dir);
  const std::string v_gpipe = test::write_shared_file(
      dir + "/v_gpipe.csv",
      "0F0,0F1,0F2,0F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,0B0,0B1,0B2,0B3\r\n"
      "1F0,2F0,1F1,2F1,1F2,2F2,1F3,2F3,2B0,1B0,2B1,1B1,2B2,1B2,2B3,1B3\r\n");
  expect_pipeline_parity(2, 1, 1, {"csv"}, "cpu_tiny", v_gpipe);

  const std::string deadlock = test::write_shared_file(
      dir + "/deadlock.csv",
      "0F0,0F1,0F2,0F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,0B0,0B1,0B2,0B3\n"
      "1F0,2F0,1F1,2F1,1F2,2F2,2B0,1F3,2F3,1B0,2B1,1B1,2B2,1B2,2B3,1B3\n");
  JobConfig config = base("pp_csv_deadlock", 1, 1);
  config.training.local_batch_size = 4;
  config.parallelism.pipeline_parallel_degree = 2;
  config.parallelism.pipeline_parallel_schedule_csv = deadlock;
  fsdp_test::expect_error_containing<std::exception>(
      [&] { run_training(config, test::world_env(), false); },
      "config error: parallelism.pipeline_parallel_schedule_csv: " + deadlock + ": the schedule deadlocks");
}

// module_fqns_per_model_part: explicit stages (one module each but the last) give the same curve; bad lists,
// too few microbatches and a degree that does not divide the world are refused with the reason.
TEST(TrainerParity, PipelineExplicitStagesAndBadConfigurations) {
  auto world = fsdp::world();
  if (world->size() != 2) GTEST_SKIP() << "pp 2 on 2 ranks";
  TrainEnv single;
  single.verbose = false;
  const TrainSummary ref = run_training(base("pp_fqn_ref", 1, -1), single, false);
  JobConfig config = base("pp_fqn", 1, 1);
  config.training.local_batch_size = 4;
  config.parallelism.pipeline_parallel_degree = 2;
  config.parallelism.pipeline_parallel_schedule = PipelineSchedule::Interleaved1F1B;
  config.parallelism.module_fqns_per_model_part = {{"tok_embeddings"}, {"layers.0"}, {"layers.1"}, {"norm", "output"}};
  const TrainSummary got = run_training(config, test::world_env(), false);
  EXPECT_NE(got.plan.find("4 stages"), std::string::npos) << got.plan;
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
  }

  // ConfigError for the trainer's own checks, c10::Error from the library's: any std::exception.
  auto expect_refused = [&](JobConfig c, const std::string& needle) {
    fsdp_test::expect_error_containing<std::exception>([&] { run_training(c, test::world_env(), false); }, needle);
  };
  JobConfig order = config;
  order.job.dump_folder += "_order";
  order.parallelism.module_fqns_per_model_part = {{"tok_embeddings", "layers.1"}, {"layers.0", "norm", "output"}};
  order.parallelism.pipeline_parallel_schedule = PipelineSchedule::OneFOneB;
  expect_refused(order, "the model's next module in order is 'layers.0'");
  JobConfig missing = order;
  missing.parallelism.module_fqns_per_model_part = {{"tok_embeddings", "layers.0"}, {"layers.1", "norm"}};
  expect_refused(missing, "'output' and the modules after it are in no stage");
  JobConfig few = config;
  few.job.dump_folder += "_few";
  few.parallelism.module_fqns_per_model_part.clear();
  few.parallelism.pipeline_parallel_schedule = PipelineSchedule::OneFOneB;
  few.training.local_batch_size = 1;  // 1 microbatch for 2 stages
  few.training.global_batch_size = 1;
  expect_refused(few, "1F1B needs at least as many microbatches as stages");
  JobConfig three = config;
  three.parallelism.pipeline_parallel_degree = 3;
  expect_refused(three, "pipeline_parallel_degree (3) must divide the world size (2)");
}

TEST(TrainerParity, PipelineWithFullyShardMatchesOneRankWithAccumulation) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "pp 2 x dp_shard 2 needs 4 ranks";
  expect_pipeline_parity(2, 2, 1, {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"});
}

TEST(TrainerParity, PipelineWithFullyShardAndTensorParallelMatchesOneRankWithAccumulation) {
  if (fsdp::world()->size() != 8) GTEST_SKIP() << "pp 2 x dp_shard 2 x tp 2 needs 8 ranks";
  expect_pipeline_parity(2, 2, 2, {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"});
}

TEST(TrainerParity, ReplicateMatchesOneRankWithAccumulation) {
  expect_parity(fsdp::world()->size(), 1, "ddp", "data parallel (replicate");
}

TEST(TrainerParity, ShardMatchesOneRankWithAccumulation) { expect_parity(1, -1, "fsdp", "FSDP mesh"); }

TEST(TrainerParity, HsdpMatchesOneRankWithAccumulation) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "HSDP 2 x 2 needs 4 ranks";
  expect_parity(2, 2, "hsdp", "HSDP mesh");
}

// Tensor parallel 2 (TorchTitan's Llama plan with sequence parallel) x FSDP over the rest: on 2 ranks
// (dp 1 x tp 2) and 4 ranks (dp_shard 2 x tp 2), with and without loss parallel.
TEST(TrainerParity, TensorParallelMatchesOneRankWithAccumulation) {
  expect_parity(1, -1, "tp", "TP 2 (sequence parallel, loss parallel)", 2, true, /*validate=*/true);
}

TEST(TrainerParity, TensorParallelGatheredLogitsMatchesOneRankWithAccumulation) {
  expect_parity(1, -1, "tp_nolp", "TP 2 (sequence parallel, logits gathered)", 2, false, /*validate=*/true);
}

TEST(TrainerParity, TensorParallelWithReplicasMatchesOneRankWithAccumulation) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "replicate 2 x tp 2 needs 4 ranks";
  expect_parity(2, 1, "hsdp_tp", "TP 2 (sequence parallel, loss parallel) + HSDP", 2);
}
