// fsdp-plan's per-rank parameter shards against fsdp-train's real parallelization, reached through the model seam
// (apps/fsdp-train/model_spec.h: the family's build, init_weights and parallelize, as the trainer calls them) on
// 2 CPU ranks, for a data-parallel, a tensor-parallel and an expert-parallel layout:
//   dp2  llama3 cpu_tiny, FSDP over 2 ranks
//   tp2  llama3 cpu_tiny, TorchTitan's TP plan over 2 ranks (FSDP over 1)
//   ep2  qwen3 cpu_tiny_moe, FSDP over 2 ranks with the routed experts split over ep 2 (efsdp 1)
// For every FSDP unit (each block and the root) the elements rank 0 holds equal the plan's GroupPlan::shard_numel
// (rank 0's pieces are the largest: the padded sizes the plan counts); other ranks hold at most that. The units
// and their parameter counts must match one to one, so a layout the planner models differently fails here.
#include "config.h"
#include "model_spec.h"
#include "parallel_dims.h"
#include "plan.h"

#include <fsdp/models/qwen3.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 258;  // the byte-level tokenizer's, as the trainer builds the model

struct Layout {
  std::string name, flavor;
  int64_t tp = 1, ep = 1;
};

// The FSDP unit a parameter belongs to: "layers.<i>" for a block's, "root" for the rest (the plan's names).
std::string unit_of(const std::string& fqn) {
  if (fqn.rfind("layers.", 0) != 0) return "root";
  return fqn.substr(0, fqn.find('.', 7));
}

std::map<std::string, int64_t> shard_for_real(const Layout& l) {
  auto world = fsdp::world();
  const fsdp_train::JobConfig config = fsdp_train::load_config(
      {"--model.name", l.name, "--model.flavor", l.flavor, "--training.seq_len", "16", "--training.local_batch_size",
       "1", "--training.global_batch_size", std::to_string(world->size() / l.tp),
       "--parallelism.tensor_parallel_degree", std::to_string(l.tp), "--parallelism.expert_parallel_degree",
       std::to_string(l.ep)});
  const fsdp_train::ParallelDims dims = fsdp_train::resolve_parallelism(config, world->size());
  const fsdp_train::TrainSpec& spec = fsdp_train::train_spec(l.name);
  spec.check_layout(config, dims);
  fsdp_train::ModelShape shape;
  shape.vocab_size = kVocab;
  shape.max_seq_len = 16;
  fsdp_train::TrainModel model = spec.build(config, shape);
  model.init_weights(0, {});  // TP and EP layouts need the whole model first (plan_needs_full_init)
  const fsdp_train::ParallelPlan plan = spec.parallelize(model, config, dims, world);
  EXPECT_TRUE(plan.fsdp) << plan.description;
  std::map<std::string, int64_t> held;
  for (const auto& item : model.module->named_parameters()) held[unit_of(item.key())] += item.value().numel();
  return held;
}

void check(const Layout& l) {
  const int64_t world = fsdp::world()->size();
  ASSERT_EQ(world, 2) << "written for 2 ranks";
  SCOPED_TRACE(l.name + " " + l.flavor + " tp " + std::to_string(l.tp) + " ep " + std::to_string(l.ep));
  fsdp::plan::PlanConfig c;
  c.model = l.name;
  c.flavor = l.flavor;
  c.args = fsdp::nn::llama::model_flavor(l.name, l.flavor);
  c.args.vocab_size = kVocab;
  c.tp = l.tp;
  c.shard = world / l.tp;
  c.ep = l.ep;
  c.seq_len = 16;
  const fsdp::plan::Plan p = fsdp::plan::make_plan(c);
  const std::map<std::string, int64_t> held = shard_for_real(l);
  ASSERT_EQ(held.size(), p.groups.size());
  int64_t total = 0;
  for (const auto& g : p.groups) {
    ASSERT_TRUE(held.count(g.name)) << g.name << " is planned but fsdp-train has no such unit";
    if (fsdp::world()->rank() == 0) EXPECT_EQ(held.at(g.name), g.shard_numel) << g.name;
    else EXPECT_LE(held.at(g.name), g.shard_numel) << g.name;
    total += held.at(g.name);
  }
  // Not vacuous: the layout actually split the model (each rank holds less than the whole).
  EXPECT_LT(total, p.num_params);
  EXPECT_GT(total, 0);
}

}  // namespace

TEST(PlanShardsVsTrainer, DataParallel2) { check({"llama3", "cpu_tiny"}); }
TEST(PlanShardsVsTrainer, TensorParallel2) { check({"llama3", "cpu_tiny", /*tp=*/2}); }
TEST(PlanShardsVsTrainer, ExpertParallel2) { check({"qwen3", "cpu_tiny_moe", /*tp=*/1, /*ep=*/2}); }
