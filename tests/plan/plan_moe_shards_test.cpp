// fsdp-plan's per-rank sharded parameters of a Qwen3-MoE model against fsdp-train's real parallelization: 4 ranks
// run parallelize_llama (apps/fsdp-train/parallelize.cpp: expert parallelism over ep consecutive ranks, the
// experts' FSDP over efsdp = 4 / ep with a per-parameter mesh, Shard(1) when there are more shards than experts,
// fully_shard per block and on the root) and compare the local tensors they hold with the plan:
//   sum of local parameter bytes (rank 0)    == plan.memory.params (float32; rank 0's slices are the padded
//                                                size the plan counts)
//   local bytes of the routed experts        == the plan's expert shards (GroupPlan::expert_shard_numel)
//   each local expert weight's shape         == [E/ep, ...] cut on the planned dim into efsdp pieces
#include "config.h"
#include "models/llama3/parallelize_llama.h"
#include "plan.h"

#include <fsdp/models/qwen3.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <string>

using namespace fsdp::plan;
namespace llama = fsdp::models::llama;

namespace {

struct Held {
  int64_t all = 0, experts = 0;  // local parameter bytes
  std::vector<std::vector<int64_t>> expert_shapes;
};

Held shard_for_real(const llama::LlamaArgs& args, int64_t ep) {
  auto world = fsdp::world();
  const fsdp_train::JobConfig config = fsdp_train::load_config(
      {"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe", "--training.local_batch_size", "1",
       "--training.global_batch_size", std::to_string(world->size()), "--parallelism.expert_parallel_degree",
       std::to_string(ep)});
  const fsdp_train::ParallelDims dims = fsdp_train::resolve_parallelism(config, world->size());
  EXPECT_EQ(dims.ep, ep);
  EXPECT_EQ(dims.dp_shard, world->size());
  llama::Transformer model(args);
  model->init_weights(0);
  const fsdp_train::ParallelPlan plan = fsdp_train::llama3::parallelize_llama(model, config, dims, world);
  EXPECT_TRUE(plan.fsdp) << plan.description;
  Held held;
  for (const auto& item : model->named_parameters()) {
    const int64_t bytes = item.value().numel() * static_cast<int64_t>(item.value().element_size());
    held.all += bytes;
    if (item.key().find(".moe.experts.") != std::string::npos) {
      held.experts += bytes;
      held.expert_shapes.push_back(item.value().sizes().vec());
    }
  }
  return held;
}

void check(const llama::LlamaArgs& args, int64_t ep) {
  const int64_t world = fsdp::world()->size();
  ASSERT_EQ(world, 4) << "written for 4 ranks";
  SCOPED_TRACE("experts " + std::to_string(args.moe_options().num_experts) + ", ep " + std::to_string(ep));
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_tiny_moe";
  c.args = args;
  // The planner builds cpu_tiny_moe through the trainer's model seam; a changed expert count is a model of the
  // family built otherwise (the family's parallelize still runs on it).
  if (args.moe_options().num_experts != llama::qwen3_flavor("cpu_tiny_moe").moe_options().num_experts) {
    c.build_model = [args]() {
      llama::LlamaArgs meta = args;
      meta.device = c10::Device(c10::kMeta);
      return std::static_pointer_cast<torch::nn::Module>(llama::Transformer(meta).ptr());
    };
  }
  c.shard = world;
  c.ep = ep;
  const Plan p = make_plan(c);
  int64_t planned_experts = 0;
  for (const auto& g : p.groups) planned_experts += g.expert_shard_numel * 4;
  const Held held = shard_for_real(args, ep);
  // The plan counts each rank's padded slice, ceil(size / n) of the shard dim (what fully_shard stores). Rank 0
  // holds exactly that of every parameter; a rank past the end of a short dim (the 2-expert router gate [2, 64]
  // over 4 ranks) sees fewer elements in its local tensor than its zero-padded storage.
  if (fsdp::world()->rank() == 0) {
    EXPECT_EQ(held.all, p.memory.params);
  } else {
    EXPECT_LE(held.all, p.memory.params);
  }
  EXPECT_EQ(held.experts, planned_experts);
  EXPECT_GT(held.experts, 0);
  // The shapes: [E/ep, F, D] (w1, w3) or [E/ep, D, F] (w2), cut into efsdp pieces on the planned dim.
  const auto o = args.moe_options();
  const int64_t efsdp = world / ep, dim = p.groups[0].expert_shard_dim;
  ASSERT_EQ(held.expert_shapes.size(), 3u * static_cast<size_t>(args.n_layers));
  for (const auto& shape : held.expert_shapes) {
    ASSERT_EQ(shape.size(), 3u);
    const int64_t el = o.num_experts / ep;
    EXPECT_EQ(shape[0], dim == 0 ? el / efsdp : el);
    const bool w2 = shape[2] == o.hidden;  // [E, D, F]
    const int64_t d1 = w2 ? args.dim : o.hidden;
    EXPECT_EQ(shape[1], dim == 1 ? d1 / efsdp : d1);
  }
  if (fsdp::world()->rank() == 0) {
    std::printf("[plan-moe-shards] experts %lld ep %lld: planned %lld param bytes per rank (experts %lld, Shard(%lld)),"
                " fully_shard holds %lld (experts %lld)\n",
                static_cast<long long>(o.num_experts), static_cast<long long>(ep),
                static_cast<long long>(p.memory.params), static_cast<long long>(planned_experts),
                static_cast<long long>(dim), static_cast<long long>(held.all), static_cast<long long>(held.experts));
  }
}

}  // namespace

TEST(PlanMoEShards, Qwen3TinyMoEShardZero) {
  // 8 experts over 4 shard ranks: Shard(0); ep 1 (experts in the blocks' groups), 2 (efsdp 2), 4 (efsdp 1).
  const llama::LlamaArgs args = llama::qwen3_flavor("cpu_tiny_moe");
  for (int64_t ep : {1, 2, 4}) check(args, ep);
}

TEST(PlanMoEShards, TwoExpertsShardOne) {
  // 2 experts over 4 shard ranks: Shard(1) (F of w1 / w3, D of w2), with ep 1 and ep 2.
  llama::LlamaArgs args = llama::qwen3_flavor("cpu_tiny_moe");
  args.moe->num_experts = 2;
  args.moe->top_k = 1;
  for (int64_t ep : {1, 2}) check(args, ep);
}
