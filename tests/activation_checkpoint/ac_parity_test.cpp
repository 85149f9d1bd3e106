// Activation checkpointing parity: loss and every gradient equal to the same run without checkpointing (fp32,
// 1e-6) for full, every-k (layer SAC) and op-level SAC, without fully_shard and with it in both nestings
// (checkpoint + fully_shard on the same block, in either order; checkpointed blocks inside a sharded root), and
// under mixed precision. Dropout is on; every run seeds it the same way. Each case also checks that
// checkpointing ran (recomputations, kept/reused matmuls), that it adds no collective, and that no unsharded
// parameter is left after backward.
#include "comm/dist_env.h"
#include "activation_checkpoint/ac_test_model.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using namespace ac_test;

namespace {
constexpr int64_t kBlocks = 4, kSteps = 2, kBatch = 3, kSeq = 6;

enum class Mode { None, Full, EveryK, Op };
enum class Sharding { None, SameModule, SameModuleShardFirst, ParentOnly, SameModuleBf16 };

fsdp::DeviceMesh world_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {fsdp_test::test_world()->size()}, {"shard"});
  return mesh;
}

const char* name(Mode m) {
  switch (m) {
    case Mode::None: return "none";
    case Mode::Full: return "full";
    case Mode::EveryK: return "every-2";
    case Mode::Op: return "op";
  }
  return "?";
}

struct Run {
  std::vector<double> losses;
  std::vector<std::map<std::string, torch::Tensor>> grads;  // per step, this rank's (sharded) gradients
  std::vector<int64_t> param_numel_after_backward;           // per step: what the parameters show
  fsdp::CheckpointStats stats;
  fsdp::CommStats comm;
  size_t checkpointed = 0;
};

void apply_ac(Model& model, Mode mode, Run& run) {
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (size_t i = 0; i < model->blocks->size(); ++i) blocks.push_back(model->blocks[i]);
  switch (mode) {
    case Mode::None: break;
    case Mode::Full: run.checkpointed = fsdp::checkpoint_every_kth(blocks, 1); break;
    case Mode::EveryK: run.checkpointed = fsdp::checkpoint_every_kth(blocks, 2); break;
    case Mode::Op:
      run.checkpointed = fsdp::checkpoint_every_kth(blocks, 1, {fsdp::CheckpointPolicy::SelectiveOp});
      break;
  }
}

Run train(Mode mode, Sharding sharding) {
  auto world = fsdp_test::test_world();
  const int64_t rank = world->rank();
  Model model = make_model(kBlocks);
  Run run;
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  auto group = world_mesh().group(0);
  if (sharding == Sharding::SameModuleBf16) opts.mp_policy.param_dtype = torch::kBFloat16;
  const bool shard_blocks = sharding != Sharding::None && sharding != Sharding::ParentOnly;
  if (sharding != Sharding::SameModuleShardFirst) apply_ac(model, mode, run);  // TorchTitan's order: AC, then FSDP
  if (shard_blocks) {
    for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks[i], opts);
  }
  if (sharding != Sharding::None) fsdp::fully_shard(model, opts);
  if (sharding == Sharding::SameModuleShardFirst) apply_ac(model, mode, run);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  fsdp::reset_checkpoint_stats(model);
  fsdp::reset_comm_stats(*group);
  for (int64_t step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + 10 * step + rank);
    auto x = torch::randn({kBatch, kSeq, 5}, gen);
    auto y = torch::randn({kBatch, kSeq, 3}, gen);
    torch::manual_seed(900 + step + 100 * rank);  // dropout
    optim.zero_grad();
    auto out = fsdp::nn::call(model, x);
    auto loss = torch::mse_loss(out.to(torch::kFloat), y);
    loss.backward();
    run.losses.push_back(loss.item<double>());
    std::map<std::string, torch::Tensor> grads;
    int64_t numel = 0;
    for (const auto& p : model->named_parameters()) {
      numel += p.value().numel();
      if (p.value().grad().defined()) grads[p.key()] = p.value().grad().clone();
    }
    run.grads.push_back(grads);
    run.param_numel_after_backward.push_back(numel);
    optim.step();
  }
  run.stats = fsdp::checkpoint_stats(model);
  run.comm = fsdp::comm_stats(*group);
  return run;
}

void expect_parity(Mode mode, Sharding sharding) {
  SCOPED_TRACE(std::string("mode ") + name(mode) + ", sharding " + std::to_string(static_cast<int>(sharding)));
  const Run ref = train(Mode::None, sharding);
  const Run ac = train(mode, sharding);
  ASSERT_EQ(ref.losses.size(), ac.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    // bf16 (SameModuleBf16) too: the same bf16 ops run in the same order, so the 1e-6 bound holds there as well.
    const double total_norm = ac_test::expect_same_step(ac.losses[s], ref.losses[s], ac.grads[s], ref.grads[s], s);
    EXPECT_GT(total_norm, 0.0) << "the reference must move";
    EXPECT_EQ(ac.param_numel_after_backward[s], ref.param_numel_after_backward[s]) << "unsharded parameters left";
  }
  // No collective added or doubled by recomputation.
  EXPECT_EQ(ac.comm.all_gather_calls, ref.comm.all_gather_calls);
  EXPECT_EQ(ac.comm.reduce_scatter_calls, ref.comm.reduce_scatter_calls);
  EXPECT_EQ(ac.comm.all_reduce_calls, ref.comm.all_reduce_calls);
  // Checkpointing ran.
  const int64_t per_step = mode == Mode::EveryK ? kBlocks / 2 : kBlocks;
  EXPECT_EQ(static_cast<int64_t>(ac.checkpointed), per_step);
  EXPECT_EQ(ac.stats.forwards, per_step * kSteps);
  EXPECT_EQ(ac.stats.recomputes, per_step * kSteps);
  if (mode == Mode::Op) {
    // 7 matmuls per block: the 1st, 3rd, 5th and 7th are kept and handed back, 3 are computed again.
    EXPECT_EQ(ac.stats.mm_saved, 4 * per_step * kSteps);
    EXPECT_EQ(ac.stats.mm_reused, 4 * per_step * kSteps);
    EXPECT_EQ(ac.stats.mm_recomputed, 3 * per_step * kSteps);
  } else {
    EXPECT_EQ(ac.stats.mm_saved + ac.stats.mm_reused + ac.stats.mm_recomputed, 0);
  }
}
}  // namespace

TEST(ActivationCheckpointParity, WithoutFullyShard) {
  for (Mode m : {Mode::Full, Mode::EveryK, Mode::Op}) expect_parity(m, Sharding::None);
}

TEST(ActivationCheckpointParity, SameModuleAsFullyShard) {
  for (Mode m : {Mode::Full, Mode::EveryK, Mode::Op}) expect_parity(m, Sharding::SameModule);
}

TEST(ActivationCheckpointParity, SameModuleCheckpointedAfterFullyShard) {
  for (Mode m : {Mode::Full, Mode::Op}) expect_parity(m, Sharding::SameModuleShardFirst);
}

TEST(ActivationCheckpointParity, ChildOfShardedRoot) {
  for (Mode m : {Mode::Full, Mode::EveryK, Mode::Op}) expect_parity(m, Sharding::ParentOnly);
}

TEST(ActivationCheckpointParity, MixedPrecisionCastsApplyInRecompute) {
  for (Mode m : {Mode::Full, Mode::Op}) expect_parity(m, Sharding::SameModuleBf16);
}
