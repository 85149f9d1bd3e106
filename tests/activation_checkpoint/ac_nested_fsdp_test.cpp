// Activation checkpointing around modules whose submodules were given to fully_shard (PyTorch's
// test_double_forward_with_nested_fsdp_and_checkpoint and its relatives): the recomputation in backward runs the
// sharded submodules' forward again, which gathers their parameters, and their backward runs through their own
// FSDP hooks. Losses and every gradient (this rank's shards) equal the same sharding without checkpointing
// (fp32, 1e-6, dropout on), for: blocks and their feed-forward children both sharded under a sharded root;
// only the children sharded (under a sharded root, and with no FSDP root at all: each child its own root); the
// root itself checkpointed around sharded blocks. With two forwards before one backward as well. Each case
// checks that checkpointing recomputed and that the recomputation gathered the children's parameters.
#include "comm/dist_env.h"
#include "activation_checkpoint/ac_test_model.h"

#include <fsdp/comm_stats.h>
#include <fsdp/activation_checkpoint.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using namespace ac_test;

namespace {
constexpr int64_t kBlocks = 3, kSteps = 3, kBatch = 3, kSeq = 6;

fsdp::DeviceMesh world_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {fsdp_test::test_world()->size()}, {"shard"});
  return mesh;
}

struct Case {
  const char* name;
  bool shard_blocks = false;      // fully_shard each block (the checkpointed module when checkpoint_root is false)
  bool shard_root = true;         // fully_shard the model
  bool checkpoint_root = false;   // checkpoint the model instead of each block
  bool double_forward = false;    // two forwards, one backward of their sum
  // Every block's feed-forward child is always sharded.
};

struct Run {
  std::vector<double> losses;
  std::vector<std::map<std::string, torch::Tensor>> grads;  // per step, this rank's (sharded) gradients
  fsdp::CheckpointStats stats;
  int64_t all_gathers = 0;
};

Run train(const Case& c, bool checkpoint) {
  const int64_t rank = fsdp_test::test_world()->rank();
  Model model = make_model(kBlocks);
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  auto group = world_mesh().group(0);
  // TorchTitan's order: checkpointing first, then fully_shard bottom-up.
  if (checkpoint) {
    if (c.checkpoint_root) {
      fsdp::checkpoint_module(model);
    } else {
      for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::checkpoint_module(model->blocks[i]);
    }
  }
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    fsdp::fully_shard(model->blocks[i]->as<BlockImpl>()->ffn, opts);
    if (c.shard_blocks) fsdp::fully_shard(model->blocks[i], opts);
  }
  if (c.shard_root) fsdp::fully_shard(model, opts);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  fsdp::reset_checkpoint_stats(model);
  fsdp::reset_comm_stats(*group);
  Run run;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + 10 * step + rank);
    auto x = torch::randn({kBatch, kSeq, 5}, gen);
    auto y = torch::randn({kBatch, kSeq, 3}, gen);
    torch::manual_seed(300 + step + 100 * rank);  // dropout
    optim.zero_grad();
    auto call_model = [&] { return c.shard_root || c.checkpoint_root ? fsdp::nn::call(model, x) : model->forward(x); };
    auto out = call_model();
    if (c.double_forward) out = out + 0.5 * call_model();
    auto loss = torch::mse_loss(out, y);
    loss.backward();
    run.losses.push_back(loss.item<double>());
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : model->named_parameters()) {
      if (p.value().grad().defined()) grads[p.key()] = p.value().grad().clone();
    }
    run.grads.push_back(grads);
    optim.step();
  }
  run.stats = fsdp::checkpoint_stats(model);
  run.all_gathers = fsdp::comm_stats(*group).all_gather_calls;
  return run;
}

void expect_parity(const Case& c) {
  SCOPED_TRACE(c.name);
  const Run ref = train(c, /*checkpoint=*/false);
  const Run ac = train(c, /*checkpoint=*/true);
  ASSERT_EQ(ref.losses.size(), ac.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double total_norm = ac_test::expect_same_step(ac.losses[s], ref.losses[s], ac.grads[s], ref.grads[s], s);
    EXPECT_GT(total_norm, 0.0) << "the reference must move";
    EXPECT_GE(ref.grads[s].size(), 10u) << "every parameter gets a gradient";
  }
  // Checkpointing ran: one region per checkpointed call, each recomputed once.
  const int64_t calls = (c.checkpoint_root ? 1 : kBlocks) * (c.double_forward ? 2 : 1) * kSteps;
  EXPECT_EQ(ac.stats.forwards, calls);
  EXPECT_EQ(ac.stats.recomputes, calls);
  EXPECT_EQ(ref.stats.recomputes, 0);
  // The recomputation ran the sharded children's forward again, gathering their parameters.
  EXPECT_GT(ac.all_gathers, ref.all_gathers);
}
}  // namespace

TEST(CheckpointAroundShardedSubmodules, BlocksAndChildrenSharded) {
  expect_parity({"blocks and children sharded", /*shard_blocks=*/true});
}

TEST(CheckpointAroundShardedSubmodules, OnlyChildrenShardedUnderShardedRoot) {
  expect_parity({"only children sharded", /*shard_blocks=*/false});
}

TEST(CheckpointAroundShardedSubmodules, OnlyChildrenShardedNoFsdpRoot) {
  expect_parity({"only children sharded, no FSDP root", /*shard_blocks=*/false, /*shard_root=*/false});
}

TEST(CheckpointAroundShardedSubmodules, DoubleForwardCheckpointedBlocks) {
  expect_parity({"double forward, checkpointed sharded blocks", /*shard_blocks=*/true, /*shard_root=*/true,
                 /*checkpoint_root=*/false, /*double_forward=*/true});
}

TEST(CheckpointAroundShardedSubmodules, DoubleForwardWithNestedFsdpAndCheckpointedRoot) {
  // PyTorch's test_double_forward_with_nested_fsdp_and_checkpoint: sharded submodules, the root checkpointed
  // and sharded, two forwards, one backward.
  expect_parity({"double forward, checkpointed sharded root", /*shard_blocks=*/true, /*shard_root=*/true,
                 /*checkpoint_root=*/true, /*double_forward=*/true});
}

TEST(CheckpointAroundShardedSubmodules, SelectiveOpAroundShardedSubmodulesIsRefused) {
  Model model = make_model(2);
  fsdp::FullyShardOptions opts;
  opts.mesh = world_mesh();
  fsdp::checkpoint_module(model->blocks[0], {fsdp::CheckpointPolicy::SelectiveOp});
  fsdp::fully_shard(model->blocks[0]->as<BlockImpl>()->ffn, opts);
  fsdp::fully_shard(model, opts);
  auto x = torch::randn({kBatch, kSeq, 5});
  try {
    fsdp::nn::call(model, x);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("contains 'ffn', which was given to fully_shard; op-level selective checkpointing"),
              std::string::npos) << what;
  }
  // The refused forward left the tree usable: an evaluation forward (no region recorded) runs.
  EXPECT_NO_THROW({
    torch::NoGradGuard no_grad;
    fsdp::nn::call(model, x);
  });
}
