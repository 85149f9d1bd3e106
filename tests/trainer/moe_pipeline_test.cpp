// MoE under pipeline parallelism through the trainer (qwen3 cpu_tiny_moe: 2 layers, each an MoE block of 8
// experts, top-2), against 1 rank with gradient accumulation over the same global batches (4 samples of 16 tokens
// per data-parallel rank and step, in 4 microbatches): the loss and grad norm of every step (1e-5 / 1e-4
// relative, as the dense pipeline and MoE parity tests), the expert load of every step exactly (each layer's
// busiest and idlest expert, summed over the ranks of the layer's stage: every rank reports every layer, also
// those its stages do not hold) and the L1 norm of the load-balancing bias (updated per stage from its ranks'
// counts, so the routing of later steps follows it).
// Layouts: pp 2 on 2 ranks under 1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
// DualPipeV and a CSV file (the last six put 2 stages on each rank: embedding | layer 0 | layer 1 | norm + output,
// so some stages hold no MoE layer); pp 2 x dp_shard 2 and pp 2 x ep 2 (ep borrowing the stage's 2 dp_shard
// ranks) on 4 ranks. DeepSeek-V3's sequence balance loss, attached to each stage's backward per microbatch,
// equals the 1-rank value (without that attachment the grad norms and then the expert loads differ: checked by
// hand once, 2.3e-4 relative on step 1's grad norm). With TP in the stages (trainer_moe_pipeline_tp_test): pp 2 x
// tp 2, pp 2 x tp 2 with EP 2, pp 2 x tp 2 with the balance loss (4 ranks), pp 2 x dp_shard 2 x tp 2 with EP 2 (8).
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

using namespace fsdp_train;

namespace {

enum class Routing { Qwen3, DeepSeekV3 };

// 4 samples per data-parallel rank (pp 2 on the world): 4 microbatches of 1, as many as DualPipeV's 4 stages need.
// Under TP the tp ranks of a data-parallel rank share its samples.
int64_t global_batch(int64_t tp = 1) { return 2 * fsdp::world()->size() / tp; }

JobConfig base(const std::string& name, Routing routing, double aux_coeff, int64_t tp = 1) {
  JobConfig c = load_config({"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe", "--training.seq_len", "16",
                             "--training.local_batch_size", "1", "--training.global_batch_size",
                             std::to_string(global_batch(tp)), "--training.steps", "8", "--lr_scheduler.warmup_steps",
                             "2",
                             "--metrics.peak_tflops", "1"});
  if (routing == Routing::DeepSeekV3) {
    c.model.moe_score_func = MoeScoreFunc::Sigmoid;
    c.model.moe_shared_experts = 1;
    c.model.moe_route_norm = MoeRouteNorm::On;
    c.model.moe_route_scale = 2.5;
    c.model.moe_num_expert_groups = 4;
    c.model.moe_num_limited_groups = 2;
  }
  c.model.moe_sequence_aux_loss_coeff = aux_coeff;
  // The 1-rank references, run by every process, get a folder each; distributed runs share one.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_moe_pp_" + name;
  const bool per_rank = name.size() > 4 && name.compare(name.size() - 4, 4, "_ref") == 0;
  if (per_rank) c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (per_rank || fsdp::world()->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  fsdp::world()->barrier().wait();
  return c;
}

// pp x tp x (world / pp / tp) data-parallel ranks (ep of dp x tp expert parallel) under each of `schedules` equal
// 1 rank (the reference without activation checkpointing; the pipeline runs with full AC when `full_ac`).
void expect_pipeline_parity(const std::string& name, Routing routing, int64_t pp, int64_t ep,
                            const std::vector<std::string>& schedules, double aux_coeff = 0, bool full_ac = false,
                            int64_t tp = 1) {
  auto world = fsdp::world();
  const int64_t dp = world->size() / pp / tp;
  TrainEnv single;
  single.verbose = false;
  const TrainSummary ref = run_training(base(name + "_ref", routing, aux_coeff, tp), single, false);
  ASSERT_EQ(ref.expert_loads.size(), ref.losses.size()) << "one expert-load record per step";
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0) << "the load-balancing bias moved";
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (size_t k = 0; k < schedules.size(); ++k) {
    const std::string& schedule = schedules[k];
    SCOPED_TRACE(name + " " + schedule + ": pp " + std::to_string(pp) + " x dp " + std::to_string(dp) + " x tp " +
                 std::to_string(tp) + ", ep " + std::to_string(ep));
    JobConfig config = base(name + "_" + std::to_string(k), routing, aux_coeff, tp);
    config.training.local_batch_size = global_batch(tp) / dp;  // one pipeline step per optimizer step
    config.parallelism.pipeline_parallel_degree = pp;
    config.parallelism.tensor_parallel_degree = tp;
    const bool csv = schedule.rfind("csv:", 0) == 0;  // "csv:<file>": a schedule file instead of a name
    if (csv) config.parallelism.pipeline_parallel_schedule_csv = schedule.substr(4);
    else config.parallelism.pipeline_parallel_schedule = parse_choice<PipelineSchedule>(schedule).value();
    config.parallelism.pipeline_parallel_microbatch_size = 1;
    config.parallelism.expert_parallel_degree = ep;
    if (full_ac) config.activation_checkpoint.mode = AcMode::Full;
    const TrainSummary got = run_training(config, test::world_env(), false);
    if (full_ac) EXPECT_GT(got.ac_recomputes, 0) << "activation checkpointing recomputed nothing";
    EXPECT_NE(got.plan.find("PP " + std::to_string(pp) + " (" + (csv ? "CSV " + schedule.substr(4) : schedule)),
              std::string::npos)
        << got.plan;
    if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
    else EXPECT_EQ(got.plan.find("EP "), std::string::npos) << got.plan;
    if (tp > 1) EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " (sequence parallel)"), std::string::npos)
        << got.plan;
    else EXPECT_EQ(got.plan.find("TP "), std::string::npos) << got.plan;
    test::expect_moe_steps_equal(ref, got, 2, /*compare_mean=*/true);  // every token of the batch, counted once
    ASSERT_EQ(got.aux_losses.size(), aux_coeff > 0 ? got.losses.size() : 0u);
    ASSERT_EQ(ref.aux_losses.size(), got.aux_losses.size());
    for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
      EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
      EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "balance loss, step " << i + 1;
    }
  }
}

}  // namespace

TEST(TrainerMoEPipeline, PipelineEqualsOneRank) {
  const int64_t n = fsdp::world()->size();
  if (n == 2) {
    // One stage per rank (1F1B, GPipe), then two (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble: loop
    // placement; ZBVZeroBubble, DualPipeV: V placement, DualPipeV with its overlapped forward-backward pairs),
    // and a CSV schedule: a V-shaped GPipe no name gives (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2).
    const std::string dir = ::testing::TempDir() + "/fsdp_train_moe_pp_csv";
    std::filesystem::create_directories(dir);
    const std::string v_gpipe = test::write_shared_file(
        dir + "/v_gpipe.csv",
        "0F0,0F1,0F2,0F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,0B0,0B1,0B2,0B3\n"
        "1F0,2F0,1F1,2F1,1F2,2F2,1F3,2F3,2B0,1B0,2B1,1B1,2B2,1B2,2B3,1B3\n");
    expect_pipeline_parity("pp2", Routing::Qwen3, 2, 1,
                           {"1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                            "DualPipeV", "csv:" + v_gpipe});
  } else if (n == 4) {
    expect_pipeline_parity("pp2_dp2", Routing::DeepSeekV3, 2, 1, {"1F1B", "ZBVZeroBubble"});
  } else {
    GTEST_SKIP() << "pp 2 on 2 or 4 ranks";
  }
}

TEST(TrainerMoEPipeline, PipelineWithExpertParallelEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "pp 2 x ep 2 needs 4 ranks";
  expect_pipeline_parity("pp2_ep2", Routing::Qwen3, 2, 2, {"1F1B", "Interleaved1F1B", "DualPipeV"});
  expect_pipeline_parity("pp2_ep2_dsv3", Routing::DeepSeekV3, 2, 2, {"1F1B"});
}

TEST(TrainerMoEPipeline, SequenceBalanceLossThroughTheStagesEqualsOneRank) {
  // Each stage attaches its layers' balance loss to its own backward per microbatch: no stage's loss reaches the
  // last stage's output, and yet the steps equal the 1-rank run, where the loss is added to the microbatch's.
  const int64_t n = fsdp::world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "pp 2 on 2 or 4 ranks";
  expect_pipeline_parity("pp_aux", Routing::DeepSeekV3, 2, n == 4 ? 2 : 1, {"1F1B", "DualPipeV"}, /*aux_coeff=*/0.05);
  // With full activation checkpointing in the stages: the first pass runs without gradients, the recomputation
  // ties each layer's loss once (with the microbatch's scale), the experts' tokens are counted once.
  expect_pipeline_parity("pp_aux_ac", Routing::DeepSeekV3, 2, 1, {"1F1B"}, /*aux_coeff=*/0.05, /*full_ac=*/true);
  // ... and the balance loss changed the training (its gradients are not lost on the way).
  TrainEnv single;
  single.verbose = false;
  const TrainSummary without = run_training(base("pp_aux_off_ref", Routing::DeepSeekV3, 0), single, false);
  const TrainSummary with = run_training(base("pp_aux_on_ref", Routing::DeepSeekV3, 0.05), single, false);
  EXPECT_GT(std::abs(with.grad_norms[0] - without.grad_norms[0]), 1e-6 * without.grad_norms[0]);
}

// MoE under pipeline and tensor parallelism together (issue 37): inside each stage the TP plan of the MoE blocks
// (router replicated with its gradient all-reduced over TP, shared experts colwise/rowwise, tokens sequence-sharded),
// EP borrowing its ranks from the stage's dp_shard x tp and the experts' FSDP over what is left; each stage's
// expert loads summed over its dp x tp ranks (each TP rank routes its own slice of the sequence).
TEST(TrainerMoEPipelineTensorParallel, PipelineWithTensorParallelEqualsOneRank) {
  const int64_t n = fsdp::world()->size();
  if (n == 4) {
    // pp 2 x tp 2: one stage per rank, then Interleaved1F1B's 4 stages (embedding | layer 0 | layer 1 | norm +
    // output: the stages keep only their own layers' TP entries); DeepSeek-V3 routing (a tensor-parallel shared
    // expert) with EP 2 borrowing the TP ranks.
    expect_pipeline_parity("pp2_tp2", Routing::Qwen3, 2, 1, {"1F1B", "Interleaved1F1B"}, 0, false, /*tp=*/2);
    expect_pipeline_parity("pp2_tp2_ep2_dsv3", Routing::DeepSeekV3, 2, 2, {"1F1B"}, 0, false, /*tp=*/2);
    // The sequence balance loss on whole sequences (each block sums its counts over the stage's TP ranks).
    expect_pipeline_parity("pp2_tp2_aux", Routing::DeepSeekV3, 2, 1, {"1F1B"}, /*aux_coeff=*/0.05, false, /*tp=*/2);
  } else if (n == 8) {
    // The acceptance layout: pp 2 x dp_shard 2 x tp 2 with EP 2 (efsdp 2 per stage).
    expect_pipeline_parity("pp2_dp2_tp2_ep2", Routing::Qwen3, 2, 2, {"1F1B"}, 0, false, /*tp=*/2);
  } else {
    GTEST_SKIP() << "pp 2 x tp 2 on 4 or 8 ranks";
  }
}
