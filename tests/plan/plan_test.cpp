// fsdp-plan: sizes and bytes checked against independent hand computations (shapes written out here from the
// Llama 3 definition, not taken from the planner).
#include "plan.h"

#include <gtest/gtest.h>

using namespace fsdp::plan;
namespace llama = fsdp::nn::llama;

namespace {
PlanConfig config(const std::string& flavor, int64_t shard, int64_t replicate = 1) {
  PlanConfig c;
  c.flavor = flavor;
  c.args = llama::llama3_flavor(flavor);
  c.shard = shard;
  c.replicate = replicate;
  c.local_batch = 2;
  c.seq_len = 64;
  return c;
}
}  // namespace

TEST(Plan, DebugmodelSizesByHand) {
  // debugmodel: dim 256, 6 layers, 16 heads (= kv heads), vocab 2048, ffn hidden 768.
  Plan p = make_plan(config("debugmodel", 1));
  const int64_t block = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256;
  const int64_t root = 2 * 2048 * 256 + 256;
  EXPECT_EQ(p.num_params, 6 * block + root);
  ASSERT_EQ(p.groups.size(), 7u);
  EXPECT_EQ(p.groups[0].numel, block);
  EXPECT_EQ(p.groups.back().numel, root);
  EXPECT_EQ(p.memory.params, (6 * block + root) * 4);
  EXPECT_EQ(p.memory.optimizer, 2 * (6 * block + root) * 4);
  EXPECT_EQ(p.comm.total_bytes, 0);  // one rank: nothing to send
}

TEST(Plan, UnevenShardPaddingAndBytes) {
  // cpu_tiny: dim 64, 4 heads / 2 kv heads (head_dim 16), vocab 2048, ffn hidden 192 (multiple_of 64).
  // Shard 3: every dim-0 is padded up to a multiple of 3.
  Plan p = make_plan(config("cpu_tiny", 3));
  auto pad = [](int64_t d0) { return (d0 + 2) / 3; };
  const int64_t block_shard = pad(64) * 64 + 2 * pad(32) * 64 + pad(64) * 64 + 2 * pad(192) * 64 + pad(64) * 192 +
                              2 * pad(64);
  EXPECT_EQ(p.groups[0].shard_numel, block_shard);
  const int64_t root_shard = 2 * pad(2048) * 64 + pad(64);
  EXPECT_EQ(p.groups.back().shard_numel, root_shard);
  // Bytes: forward + backward all-gather of blocks (16-byte aligned per parameter), forward only of the root,
  // reduce-scatter of every group: (S-1) x per-rank bytes each.
  auto a16 = [](int64_t b) { return (b + 15) / 16 * 16; };
  const int64_t block_ag = a16(pad(64) * 64 * 4) * 2 + a16(pad(32) * 64 * 4) * 2 + a16(pad(192) * 64 * 4) * 2 +
                           a16(pad(64) * 192 * 4) + a16(pad(64) * 4) * 2;
  const int64_t root_ag = a16(pad(2048) * 64 * 4) * 2 + a16(pad(64) * 4);
  EXPECT_EQ(p.comm.all_gather_bytes, 2 * (2 * 2 * block_ag + root_ag));
  EXPECT_EQ(p.comm.reduce_scatter_bytes, 2 * (2 * block_shard + root_shard) * 4);
  EXPECT_EQ(p.comm.all_gather_calls, 2 * 2 + 1);
  EXPECT_EQ(p.comm.reduce_scatter_calls, 3);
  EXPECT_LE(p.comm.optimum_bytes, p.comm.total_bytes);
}

TEST(Plan, ReshardPoliciesAndHsdp) {
  PlanConfig c = config("cpu_small", 4);
  Plan always = make_plan(c);
  c.block_reshard = 0;
  Plan never = make_plan(c);
  c.block_reshard = 2;
  Plan hpz = make_plan(c);
  // Never resharding drops the backward all-gathers of the blocks; hpZ-2 re-gathers half the bytes within pairs.
  const int64_t blocks_ag = 4 * 3 * always.groups[0].all_gather_bytes;  // (S-1) x per-rank, 4 blocks
  EXPECT_EQ(always.comm.all_gather_bytes - never.comm.all_gather_bytes, blocks_ag);
  EXPECT_EQ(hpz.comm.all_gather_bytes - never.comm.all_gather_bytes, 4 * 1 * 2 * always.groups[0].all_gather_bytes);
  // HSDP 2 x 4: all-reduce of every group's shard over 2 replicas, 2(R-1)/R of it.
  PlanConfig h = config("cpu_small", 4, 2);
  Plan hsdp = make_plan(h);
  int64_t shard_numel = 0;
  for (const auto& g : hsdp.groups) shard_numel += g.shard_numel;
  EXPECT_EQ(hsdp.comm.all_reduce_bytes, shard_numel * 4);
  EXPECT_EQ(hsdp.comm.all_reduce_calls, 5);
  EXPECT_THROW(make_plan([] { PlanConfig x = config("cpu_small", 4); x.block_reshard = 3; return x; }()), c10::Error);
}

TEST(Plan, ActivationCheckpointingOrdersMemory) {
  PlanConfig c = config("8B", 8);
  c.compute_dtype = c10::kBFloat16;
  c.local_batch = 2;
  c.seq_len = 8192;
  Plan none = make_plan(c);
  c.ac = ACMode::Selective;
  Plan sel = make_plan(c);
  c.ac = ACMode::Full;
  Plan full = make_plan(c);
  EXPECT_GT(none.memory.total, sel.memory.total);
  EXPECT_GT(sel.memory.total, full.memory.total);
  // Full AC keeps only each block's bf16 input: 2 x 8192 x 4096 x 2 bytes = 128 MiB per block.
  EXPECT_EQ(full.memory.act_per_layer_checkpointed, int64_t{2} * 8192 * 4096 * 2);
  // 70B and 405B plan without allocating anything.
  PlanConfig big = config("405B", 64);
  EXPECT_GT(make_plan(big).num_params, int64_t{400} * 1000 * 1000 * 1000);
}
