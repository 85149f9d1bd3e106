// fsdp-plan's saved activations per block under tensor parallelism against what a real block keeps from its
// forward for its backward, measured exactly, on 2 ranks (tp 2): the model is fsdp-train's (its model seam's
// build, init and parallelize: TorchTitan's TP plan with sequence parallel, MoE blocks routing their local tokens),
// the bytes are the live CPU tensor bytes of tensor_memory's counting allocator (apps/fsdp-train/tensor_memory.h)
// around each block's call in one training forward, less the block's output (the next block's to count) plus, in
// float32, its input (the first norm saves it; the planner counts it as the block's). float32, forward only (see
// plan_moe_memory_test for why). Dense Llama 3, Qwen3 with QK-norm, Qwen3-MoE: each block within 1% of
// MemoryPlan::act_per_dense_layer / act_per_moe_layer (the planner leaves out the norms' per-token rsqrt).
// fsdp-train's reshard policy is set to "always": by default the last block keeps its unsharded parameters (the
// routed experts, sharded over dp_shard x tp, all-gathered) after forward, which the plan counts apart
// (end_of_forward). Not with EP: there the all-to-all row buffers are released by Gloo's thread, some after the
// block's hook and some while the next block runs, so the process-wide count moves by one or two such buffers per
// block from run to run (tp 2 x ep 2 on 2 ranks: exact within 0.4% when quiet, else +-65 KiB or +-130 KiB per
// block at 128 tokens); docs/planner.md, "MoE under TP, PP and op-level SAC".
#include "config.h"
#include "model_spec.h"
#include "moe_balance.h"
#include "parallel_dims.h"
#include "plan.h"
#include "tensor_memory.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace tensor_memory = fsdp_train::tensor_memory;

namespace {

constexpr int64_t kVocab = 258, kBatch = 2, kSeq = 64, kTp = 2;

// Bytes each block of `name` / `flavor` keeps for backward in one training forward under tp 2 (this rank's).
std::vector<int64_t> measured_saved(const std::string& name, const std::string& flavor) {
  tensor_memory::install();
  auto world = fsdp::world();
  const fsdp_train::JobConfig config = fsdp_train::load_config(
      {"--model.name", name, "--model.flavor", flavor, "--training.seq_len", std::to_string(kSeq),
       "--training.local_batch_size", std::to_string(kBatch), "--training.global_batch_size", std::to_string(kBatch),
       "--validation.local_batch_size", std::to_string(kBatch), "--training.mixed_precision_param", "float32",
       "--parallelism.tensor_parallel_degree", std::to_string(kTp), "--parallelism.fsdp_reshard_after_forward",
       "always"});
  const fsdp_train::ParallelDims dims = fsdp_train::resolve_parallelism(config, world->size());
  const fsdp_train::TrainSpec& spec = fsdp_train::train_spec(name);
  spec.check_layout(config, dims);
  fsdp_train::ModelShape shape;
  shape.vocab_size = kVocab;
  shape.max_seq_len = kSeq;
  fsdp_train::TrainModel model = spec.build(config, shape);
  model.init_weights(0, {});
  const fsdp_train::ParallelPlan plan = spec.parallelize(model, config, dims, world);
  model.module->train();
  // Around every block's call: the live bytes before (ahead of every other pre-hook) and after (behind every
  // other hook: FSDP's reshard, TP's output redistribution).
  std::vector<torch::nn::Module*> blocks;
  for (const auto& item : model.module->named_modules()) {
    const std::string& fqn = item.key();
    if (fqn.rfind("layers.", 0) == 0 && fqn.find('.', 7) == std::string::npos) blocks.push_back(item.value().get());
  }
  EXPECT_GT(blocks.size(), 0u);
  std::vector<int64_t> saved(blocks.size(), 0), before(blocks.size(), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    fsdp::nn::register_forward_pre_hook(
        *blocks[i], [&, i](torch::nn::Module&, fsdp::nn::TensorList&) { before[i] = tensor_memory::live_bytes(); },
        /*prepend=*/true);
    fsdp::nn::register_forward_hook(*blocks[i], [&, i](torch::nn::Module&, const fsdp::nn::TensorList& in,
                                                       fsdp::nn::TensorList& out) {
      saved[i] = tensor_memory::live_bytes() - before[i] - static_cast<int64_t>(out.front().nbytes()) +
                 static_cast<int64_t>(in.front().nbytes());
    });
  }
  at::Generator gen = at::detail::createCPUGenerator(7);  // the TP group shares its batch
  const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, gen, at::TensorOptions().dtype(at::kLong));
  const at::Tensor logits = model.forward(tokens);
  EXPECT_TRUE(logits.requires_grad());
  // Each MoE block's experts computed every routed row of this rank (no EP: T/tp x k).
  for (auto* moe : fsdp_train::moe_layers(*model.module)) {
    EXPECT_EQ(moe->tokens_per_expert().sum().item<int64_t>(), kBatch * kSeq / kTp * moe->options().top_k);
  }
  return saved;
}

fsdp::plan::Plan plan_of(const std::string& name, const std::string& flavor) {
  fsdp::plan::PlanConfig c;
  c.model = name;
  c.flavor = flavor;
  c.args = fsdp::models::llama::model_flavor(name, flavor);
  c.args.vocab_size = kVocab;
  c.tp = kTp;
  c.shard = fsdp::world()->size() / kTp;
  c.local_batch = kBatch;
  c.seq_len = kSeq;
  return fsdp::plan::make_plan(c);
}

void check(const std::string& name, const std::string& flavor, double tolerance) {
  SCOPED_TRACE(name + " " + flavor);
  ASSERT_EQ(fsdp::world()->size(), kTp) << "written for tp 2 on 2 ranks";
  const fsdp::plan::Plan p = plan_of(name, flavor);
  const std::vector<int64_t> measured = measured_saved(name, flavor);
  ASSERT_EQ(static_cast<int64_t>(measured.size()), p.config.args.n_layers);
  for (size_t l = 0; l < measured.size(); ++l) {
    const bool moe = p.config.args.moe.has_value() && p.config.args.is_moe_layer(static_cast<int64_t>(l));
    const int64_t planned = moe ? p.memory.act_per_moe_layer : p.memory.act_per_dense_layer;
    const double rel = static_cast<double>(planned - measured[l]) / static_cast<double>(measured[l]);
    if (fsdp::world()->rank() == 0) {
      std::printf("[plan-tp-block] %s %s tp %lld, block %zu (%s): planned %lld bytes, measured %lld (%+.2f%%)\n",
                  name.c_str(), flavor.c_str(), static_cast<long long>(kTp), l, moe ? "MoE" : "dense",
                  static_cast<long long>(planned), static_cast<long long>(measured[l]), 100 * rel);
    }
    EXPECT_GT(measured[l], 0);
    EXPECT_LE(std::abs(rel), tolerance) << "block " << l << ": planned " << planned << ", measured " << measured[l];
  }
}

}  // namespace

TEST(PlanTpBlockMemory, Llama3Dense) { check("llama3", "cpu_small", 0.01); }
TEST(PlanTpBlockMemory, Qwen3QkNorm) { check("qwen3", "cpu_small", 0.01); }
TEST(PlanTpBlockMemory, Qwen3MoE) { check("qwen3", "cpu_small_moe", 0.01); }
