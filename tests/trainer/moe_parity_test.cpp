// MoE through the trainer (qwen3 cpu_tiny_moe: 2 layers, each an MoE block of 8 experts, top-2): W ranks with
// expert parallelism equal 1 rank with gradient accumulation 4 over the same global batches — the loss and grad
// norm of every step (1e-5 / 1e-4 relative, as the dense parity tests), and the expert load of every step (the
// tokens each layer's busiest and idlest expert received, summed over the ranks) exactly, which also shows that
// the load-balancing bias, which steers the routing, was updated identically (its L1 norm is compared too).
// Layouts: ep 2 on 2 ranks; ep 2 and ep 4 on 4 ranks (dp_shard 4: the experts' FSDP over the 2 or 1 ranks left);
// HSDP 2 x 2 with ep 2; MoE under TP: tp 2 (2 ranks), tp 2 x dp_shard 2, tp 2 x ep 2, tp 2 x ep 4 and HSDP 2 x tp 2 x
// ep 2 (4 ranks), the sequence balance loss at tp 2 and tp 2 x ep 2. Routing: Qwen3's (softmax, top-k
// renormalised, no shared expert) and DeepSeek-V3's
// (sigmoid, one shared expert, route scale 2.5, group-limited: 4 groups, the best 2 per token). The batches (one sample of 16 tokens per rank and step) leave
// some experts without tokens on some ranks (checked, so the zero-token path is exercised).
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"
#include "expect_error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

using namespace fsdp_train;

namespace {

enum class Routing { Qwen3, DeepSeekV3 };

JobConfig base(const std::string& name, Routing routing) {
  // One sample of 16 tokens per rank and step (the 1-rank reference accumulates W of them): 32 routed slots per
  // rank for 8 experts, so some experts get no token from some rank in some steps.
  const std::string global = std::to_string(fsdp::world()->size());
  JobConfig c = load_config({"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe", "--training.seq_len", "16",
                             "--training.local_batch_size", "1", "--training.global_batch_size", global,
                             "--training.steps", "8", "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1"});
  if (routing == Routing::DeepSeekV3) {
    c.model.moe_score_func = MoeScoreFunc::Sigmoid;
    c.model.moe_shared_experts = 1;
    c.model.moe_route_norm = MoeRouteNorm::On;
    c.model.moe_route_scale = 2.5;
    c.model.moe_num_expert_groups = 4;  // 4 groups of 2 experts, each token within its best 2 groups
    c.model.moe_num_limited_groups = 2;
  }
  // The 1-rank references, run by every process, get a folder each; distributed runs share one.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_moe_" + name;
  const bool per_rank = name.size() > 4 && name.compare(name.size() - 4, 4, "_ref") == 0;
  if (per_rank) c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (per_rank || fsdp::world()->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  fsdp::world()->barrier().wait();
  return c;
}

void expect_parity(const std::string& name, Routing routing, int64_t ep, int64_t replicate = 1, double aux_coeff = 0,
                   int64_t tp = 1) {
  auto world = fsdp::world();
  TrainEnv single;
  single.verbose = false;
  JobConfig ref_config = base(name + "_ref", routing);
  ref_config.model.moe_sequence_aux_loss_coeff = aux_coeff;
  const TrainSummary ref = run_training(ref_config, single, false);
  JobConfig config = base(name, routing);
  config.model.moe_sequence_aux_loss_coeff = aux_coeff;
  config.parallelism.data_parallel_replicate_degree = replicate;
  config.parallelism.expert_parallel_degree = ep;
  config.parallelism.tensor_parallel_degree = tp;
  const TrainSummary got = run_training(config, test::world_env(), false);
  if (tp > 1) {
    EXPECT_NE(got.plan.find("TP " + std::to_string(tp) + " (sequence parallel"), std::string::npos) << got.plan;
    // The routed experts' FSDP spans the TP ranks (each TP rank routes its own slice of the sequence).
    const int64_t efsdp = fsdp::world()->size() / replicate / ep;
    EXPECT_NE(got.plan.find("experts' FSDP over"), std::string::npos) << got.plan;
    if (ep == 1 && replicate == 1) {
      EXPECT_NE(got.plan.find("experts' FSDP over DeviceMesh(cpu, shape [" + std::to_string(efsdp) + "]"),
                std::string::npos)
          << got.plan;
    }
  }
  if (ep > 1) EXPECT_NE(got.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << got.plan;
  else EXPECT_EQ(got.plan.find("EP "), std::string::npos) << got.plan;
  EXPECT_NE(got.plan.find(replicate > 1 ? "HSDP" : "FSDP"), std::string::npos) << got.plan;
  const bool some_expert_idle_on_a_rank = test::expect_moe_steps_equal(ref, got, 2);
  EXPECT_LT(got.losses.back(), got.losses.front());
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0) << "the load-balancing bias moved";
  ASSERT_EQ(got.aux_losses.size(), aux_coeff > 0 ? got.losses.size() : 0u);
  ASSERT_EQ(ref.aux_losses.size(), got.aux_losses.size());
  for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
    EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
    EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "balance loss, step " << i + 1;
  }
  EXPECT_TRUE(some_expert_idle_on_a_rank) << "no step left an expert without tokens on a rank";
}

}  // namespace

TEST(TrainerMoE, ExpertParallelEqualsOneRank) {
  // ep = world: 2 ranks (efsdp 1) or 4 ranks (dp_shard 4, ep 4: every rank holds 2 experts)
  expect_parity("ep_world", Routing::Qwen3, fsdp::world()->size());
}

TEST(TrainerMoE, FullyShardWithoutExpertParallelEqualsOneRank) {
  // ep 1: the MoE model built on meta, sharded whole over the data-parallel ranks, materialized and initialized
  // shard by shard.
  expect_parity("fsdp_no_ep", Routing::DeepSeekV3, 1);
}

TEST(TrainerMoE, ExpertParallelDeepSeekRoutingEqualsOneRank) {
  expect_parity("ep_world_dsv3", Routing::DeepSeekV3, fsdp::world()->size());
}

TEST(TrainerMoE, ExpertParallelTwoOfFourEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "ep 2 x efsdp 2 needs 4 ranks";
  expect_parity("ep2_of_4", Routing::Qwen3, 2);
  expect_parity("ep2_of_4_dsv3", Routing::DeepSeekV3, 2);
}

TEST(TrainerMoE, ExpertParallelUnderHsdpEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "HSDP 2 x 2 with ep 2 needs 4 ranks";
  expect_parity("hsdp_ep2", Routing::DeepSeekV3, 2, /*replicate=*/2);
}

TEST(TrainerMoE, TensorParallelEqualsOneRank) {
  // MoE under TP (ep 1): tp 2 on 2 ranks, tp 2 x dp_shard 2 on 4. The router and the routed experts see each TP
  // rank's slice of the sequence (the experts sharded by FSDP over dp_shard x tp); the DeepSeek-V3 routing adds a
  // shared expert, tensor-parallel as a dense feed-forward.
  expect_parity("tp2", Routing::Qwen3, 1, 1, 0, /*tp=*/2);
  expect_parity("tp2_dsv3", Routing::DeepSeekV3, 1, 1, 0, /*tp=*/2);
}

TEST(TrainerMoE, TensorParallelDenseQwen3EqualsOneRank) {
  // What the MoE runs under TP also need, on Qwen3's dense flavor: the per-head q_norm / k_norm see only this TP
  // rank's heads, so their gradients are all-reduced over TP (without it the grad norms differ from 1 rank).
  TrainEnv single;
  single.verbose = false;
  JobConfig ref_config = base("tp2_dense_ref", Routing::Qwen3);
  ref_config.model.flavor = "cpu_tiny";
  const TrainSummary ref = run_training(ref_config, single, false);
  JobConfig config = base("tp2_dense", Routing::Qwen3);
  config.model.flavor = "cpu_tiny";
  config.parallelism.tensor_parallel_degree = 2;
  const TrainSummary got = run_training(config, test::world_env(), false);
  EXPECT_NE(got.plan.find("TP 2 (sequence parallel"), std::string::npos) << got.plan;
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  EXPECT_TRUE(got.expert_loads.empty()) << "a dense model";
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "step " << i + 1;
  }
  EXPECT_LT(got.losses.back(), got.losses.front());
}

TEST(TrainerMoE, ExpertParallelWithTensorParallelEqualsOneRank) {
  if (fsdp::world()->size() != 4) GTEST_SKIP() << "tp 2 x ep 2 needs 4 ranks";
  // TorchTitan's layout: EP borrows its ranks from dp_shard x tp (here dp_shard 2 x tp 2 = 4): ep 2 leaves the
  // experts' FSDP over 2 ranks, ep 4 over 1 (each rank holds 2 experts). Tokens are dispatched from each TP
  // rank's slice of the sequence.
  expect_parity("tp2_ep2", Routing::Qwen3, 2, 1, 0, /*tp=*/2);
  expect_parity("tp2_ep2_dsv3", Routing::DeepSeekV3, 2, 1, 0, /*tp=*/2);
  expect_parity("tp2_ep4", Routing::Qwen3, 4, 1, 0, /*tp=*/2);
  // HSDP 2 x (dp_shard 1 x tp 2) with ep 2: the experts' FSDP mesh is (dp_replicate 2, efsdp 1).
  expect_parity("hsdp_tp2_ep2", Routing::DeepSeekV3, 2, /*replicate=*/2, 0, /*tp=*/2);
}

TEST(TrainerMoE, SequenceBalanceLossEqualsOneRank) {
  // DeepSeek-V3's sequence-wise balance loss (alpha large enough to matter in 8 steps): every rank's share of
  // every microbatch's loss adds up to the 1-rank value, and its gradients to the same steps.
  expect_parity("aux", Routing::DeepSeekV3, fsdp::world()->size(), 1, /*aux_coeff=*/0.05);
  // ... and it changed the training: the first step's grad norm differs from the run without it.
  TrainEnv single;
  single.verbose = false;
  const TrainSummary without = run_training(base("aux_off_ref", Routing::DeepSeekV3), single, false);
  JobConfig with_aux = base("aux_on_ref", Routing::DeepSeekV3);
  with_aux.model.moe_sequence_aux_loss_coeff = 0.05;
  const TrainSummary with = run_training(with_aux, single, false);
  EXPECT_GT(std::abs(with.grad_norms[0] - without.grad_norms[0]), 1e-6 * without.grad_norms[0]);
}

TEST(TrainerMoE, TensorParallelSequenceBalanceLossEqualsOneRank) {
  // Under TP each rank routes a slice of every sequence; the balance loss is the whole sequence's (TorchTitan's):
  // each MoE block sums its per-sequence counts over TP and each rank's share adds up to the 1-rank loss, its
  // gradients to the same steps. tp 2 on 2 ranks, tp 2 x ep 2 on 4 (EP borrowing from dp_shard 2 x tp 2).
  const int64_t n = fsdp::world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "tp 2 on 2 or 4 ranks";
  expect_parity("tp2_aux", Routing::DeepSeekV3, n == 4 ? 2 : 1, 1, /*aux_coeff=*/0.05, /*tp=*/2);
}

TEST(TrainerMoE, BadExpertParallelConfigurationsAreRefused) {
  auto world = fsdp::world();
  if (world->size() != 2) GTEST_SKIP() << "on 2 ranks";
  const auto expect_error = fsdp_test::expect_error_containing<ConfigError>;
  JobConfig c = base("bad", Routing::Qwen3);
  c.parallelism.expert_parallel_degree = 4;  // does not divide dp_shard = 2
  expect_error([&] { run_training(c, test::world_env(), false); }, "must divide the data-parallel shard degree");
  JobConfig dense = base("bad_dense", Routing::Qwen3);
  dense.model.flavor = "cpu_tiny";
  dense.parallelism.expert_parallel_degree = 2;
  expect_error([&] { run_training(dense, test::world_env(), false); }, "has no MoE layers");
  JobConfig tp = base("bad_tp", Routing::Qwen3);
  tp.parallelism.tensor_parallel_degree = 2;
  tp.parallelism.expert_parallel_degree = 4;  // does not divide dp_shard 1 x tp 2
  expect_error([&] { run_training(tp, test::world_env(), false); },
               "must divide the data-parallel shard degree x tensor_parallel_degree (1 x 2 = 2)");
  expect_error([] { load_config({"--model.moe_score_func", "relu"}); }, "model.moe_score_func");
}
