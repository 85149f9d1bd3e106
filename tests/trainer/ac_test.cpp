// fsdp-train with [activation_checkpoint] on 2 ranks (FSDP): the loss curve with full, layer-selective (every 2nd
// block) and op-level selective checkpointing equals the run without it, and the recomputation really ran.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

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

// MoE (qwen3 cpu_tiny_moe with DeepSeek-V3's sequence-wise balance loss, alpha large enough to move the loss) under
// full, layer-selective and op-level selective AC equals the run without AC: the loss, grad norm, expert loads
// (which steer the routing through the load-balancing bias) and balance loss of every step, and the final
// parameters. The recomputation must neither add the balance loss's gradient a second time nor lose it (full AC's
// first pass has no graph), and op-level SAC, whose two passes both run with gradients, must count every token
// once. The reference is shown to depend on both: without the balance loss the grad norm differs, and the loads
// are the tokens the batches hold (top-k x tokens x layers).
namespace {

TrainSummary train_moe(const std::string& mode, const std::string& option, double aux_coeff,
                       std::map<std::string, at::Tensor>* params = nullptr) {
  JobConfig c = load_config({"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe", "--training.seq_len", "16",
                             "--training.local_batch_size", "1", "--training.global_batch_size", "4",
                             "--training.steps", "4", "--lr_scheduler.warmup_steps", "1", "--metrics.peak_tflops", "1",
                             "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", mode,
                             "--activation_checkpoint.selective_ac_option", option});
  c.model.moe_sequence_aux_loss_coeff = aux_coeff;
  c.job.dump_folder = test::shared_dir("fsdp_train_ac_moe", mode + option + (aux_coeff > 0 ? "_aux" : ""));
  if (params) {
    c.checkpoint.enable = true;
    c.checkpoint.interval = c.training.steps;
    c.checkpoint.last_save_model_only = true;
  }
  TrainSummary s = run_training(c, test::world_env(), false);
  if (params) *params = test::model_tensors(c.job.dump_folder + "/checkpoint/step-" + std::to_string(c.training.steps));
  return s;
}

}  // namespace

TEST(TrainerActivationCheckpoint, MoEWithBalanceLossEqualsRunWithout) {
  constexpr double kAux = 0.5;
  std::map<std::string, at::Tensor> ref_params;
  const TrainSummary ref = train_moe("none", "2", kAux, &ref_params);
  ASSERT_EQ(ref.aux_losses.size(), ref.losses.size());
  ASSERT_EQ(ref.expert_loads.size(), ref.losses.size());
  ASSERT_FALSE(ref_params.empty());
  // The references move: the balance loss changes the gradients ...
  const TrainSummary no_aux = train_moe("none", "2", 0);
  EXPECT_GT(std::abs(no_aux.grad_norms[0] - ref.grad_norms[0]), 1e-3 * ref.grad_norms[0]);
  // ... and the loads count every routed slot of the global batch once: 4 samples x 16 tokens x top-2 per layer,
  // over 8 experts.
  const double mean_per_expert = 4.0 * 16 * 2 / 8;
  for (const ExpertLoad& l : ref.expert_loads) {
    ASSERT_EQ(l.mean_tokens.size(), 2u) << "two MoE layers";
    for (double t : l.mean_tokens) EXPECT_EQ(t, mean_per_expert);
  }
  EXPECT_GT(ref.expert_loads.back().bias_l1, 0.0) << "the load-balancing bias moved";
  struct Case {
    const char* mode;
    const char* option;
  };
  for (const Case& c : {Case{"full", "2"}, Case{"selective", "2"}, Case{"selective", "op"}}) {
    SCOPED_TRACE(std::string(c.mode) + " " + c.option);
    std::map<std::string, at::Tensor> params;
    const TrainSummary got = train_moe(c.mode, c.option, kAux, &params);
    EXPECT_GT(got.ac_recomputes, 0);
    EXPECT_EQ(got.ac_recomputes, got.ac_forwards);
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    ASSERT_EQ(got.aux_losses.size(), ref.aux_losses.size());
    ASSERT_EQ(got.expert_loads.size(), ref.expert_loads.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
      EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-5 * ref.grad_norms[i]) << "step " << i + 1;
      EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-5 * ref.aux_losses[i]) << "step " << i + 1;
      const ExpertLoad &r = ref.expert_loads[i], &g = got.expert_loads[i];
      EXPECT_EQ(g.mean_tokens, r.mean_tokens) << "step " << i + 1;
      EXPECT_EQ(g.min_tokens, r.min_tokens) << "step " << i + 1;
      EXPECT_EQ(g.max_tokens, r.max_tokens) << "step " << i + 1;
      EXPECT_NEAR(g.bias_l1, r.bias_l1, 1e-9) << "step " << i + 1;
    }
    ASSERT_EQ(params.size(), ref_params.size());
    for (const auto& [name, want] : ref_params) {
      ASSERT_TRUE(params.count(name)) << name;
      EXPECT_TRUE(at::allclose(params.at(name), want, 1e-5, 1e-6)) << name;
    }
  }
}
