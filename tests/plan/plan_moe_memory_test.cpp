// fsdp-plan's saved-activation counts per block for Qwen3 (QK-norm; MoE blocks with routed experts) against
// what a real block keeps from its forward for its backward, measured exactly: the live CPU tensor bytes of
// tensor_memory's counting allocator (apps/fsdp-train/tensor_memory.h) after a training forward of one block,
// less those before and less the block's output (which the next block, not this one, keeps). One process, no
// expert parallelism: the block's experts see T k rows whatever the routing, so the count is exact (under EP a
// rank's rows depend on the routing; the planner assumes uniform routing there, docs/planner.md).
// float32 and forward only: CPU matmuls in bf16 (forward) and the fp32 matmul backward here allocate through
// Allocator::raw_allocate (oneDNN), which the counting allocator does not support (c10/core/Allocator.h's
// internal assert "dptr.get() == dptr.get_context()").
#include "plan.h"
#include "tensor_memory.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/qwen3.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

using namespace fsdp::plan;
namespace llama = fsdp::models::llama;
namespace tensor_memory = fsdp_train::tensor_memory;

namespace {

constexpr int64_t kBatch = 2, kSeq = 64;

// Bytes block `layer` of `args` keeps for backward, on a [kBatch, kSeq, dim] input in `dtype`.
int64_t measured_saved(llama::LlamaArgs args, int64_t layer, c10::ScalarType dtype) {
  tensor_memory::install();
  args.dtype = dtype;
  llama::TransformerBlock block(layer, args);
  at::Generator gen = at::detail::createCPUGenerator(7);
  block->init_weights(gen);
  block->train();
  const auto [cos, sin] = llama::precompute_rope(args.head_dim(), kSeq, args.rope_theta);
  const at::Tensor x = at::randn({kBatch, kSeq, args.dim}, gen, at::TensorOptions().dtype(dtype)).requires_grad_(true);
  c10::AutoGradMode grad(true);
  const int64_t before = tensor_memory::live_bytes();
  at::Tensor out = block->forward(x, cos, sin);
  const int64_t after = tensor_memory::live_bytes();
  EXPECT_TRUE(out.requires_grad());
  // The block's output belongs to the next block's count; in float32 the block's first norm saves the input
  // itself (allocated before `before`), which the planner counts as this block's.
  const int64_t saved = after - before - static_cast<int64_t>(out.nbytes()) +
                        (dtype == c10::kFloat ? static_cast<int64_t>(x.nbytes()) : 0);
  // What was counted is what autograd holds for backward: dropping the output frees the graph and with it
  // every byte counted (the check that the measurement saw saved tensors, not leftovers). In an MoE block the
  // router sent T k rows to the experts.
  if (block->moe) {
    EXPECT_EQ(block->moe->tokens_per_expert().sum().item<int64_t>(), kBatch * kSeq * args.moe_options().top_k);
  }
  out = at::Tensor();
  EXPECT_EQ(tensor_memory::live_bytes(), before);
  return saved;
}

Plan plan_of(const std::string& flavor, c10::ScalarType dtype) {
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = flavor;  // built through the trainer's model seam
  c.args = llama::qwen3_flavor(flavor);
  c.compute_dtype = dtype;
  c.param_dtype = dtype;
  c.reduce_dtype = dtype;
  c.local_batch = kBatch;
  c.seq_len = kSeq;
  return make_plan(c);
}

void expect_close(int64_t planned, int64_t measured, double tolerance, const std::string& what) {
  const double rel = static_cast<double>(planned - measured) / static_cast<double>(measured);
  std::printf("%s: planned %lld bytes, measured %lld (%+.2f%%)\n", what.c_str(), static_cast<long long>(planned),
              static_cast<long long>(measured), 100 * rel);
  EXPECT_LE(std::abs(rel), tolerance) << what << ": planned " << planned << ", measured " << measured;
}

}  // namespace

TEST(PlanMoEMemory, MoEBlockSavedActivations) {
  for (c10::ScalarType dtype : {c10::kFloat}) {
    const llama::LlamaArgs args = llama::qwen3_flavor("cpu_small_moe");
    ASSERT_TRUE(args.is_moe_layer(0));
    const Plan p = plan_of("cpu_small_moe", dtype);
    ASSERT_GT(p.memory.act_per_moe_layer, 0);
    const int64_t measured = measured_saved(args, 0, dtype);
    // The planner leaves out the main norms' float32 rsqrt (4 bytes per token and norm) and the experts' int32
    // offsets: within 1%.
    expect_close(p.memory.act_per_moe_layer, measured, 0.01, std::string("qwen3 cpu_small_moe block, ") +
                 c10::toString(dtype));
  }
}

TEST(PlanMoEMemory, QkNormDenseBlockSavedActivations) {
  for (c10::ScalarType dtype : {c10::kFloat}) {
    const llama::LlamaArgs args = llama::qwen3_flavor("cpu_small");
    ASSERT_TRUE(args.qk_norm);
    ASSERT_FALSE(args.moe.has_value());
    const Plan p = plan_of("cpu_small", dtype);
    expect_close(p.memory.act_per_dense_layer, measured_saved(args, 0, dtype), 0.01,
                 std::string("qwen3 cpu_small block (QK-norm), ") + c10::toString(dtype));
  }
}

// DeepSeek-V3 blocks (MLA: q LoRA with its norm, the kv latent with its norm, the rope key shared by every head;
// a dense block and an MoE block with a shared expert and group-limited routing) of cpu_tiny, measured the same
// way. The plan models the attention kernel as flash / memory-efficient attention save it (q, k, v, the output,
// the log-sum-exp: the CUDA kernels, and the CPU flash kernel when q/k and v head dims are equal). MLA's q/k head
// dim (24) differs from its v head dim (16), for which libtorch's CPU SDPA takes the math path instead: it saves
// copies of q (scaled), k and v and the [H, S] probabilities per token, not the output or the log-sum-exp, and
// wo then saves a copy of its [H v] input (the math output is not laid out [B, S, H, v]). So the measurement is
// the plan plus, per token, 4 H S (the probabilities) - 4 H (the log-sum-exp), plus the four norms' float32 rsqrt
// (4 bytes each, left out for every norm, as in the Qwen3 cases above).
namespace {

int64_t measured_saved_deepseek_v3(const fsdp::models::deepseek_v3::DeepSeekV3Args& args, int64_t layer) {
  namespace ds = fsdp::models::deepseek_v3;
  tensor_memory::install();
  ds::TransformerBlock block(layer, args);
  at::Generator gen = at::detail::createCPUGenerator(7);
  block->init_weights(gen);
  block->train();
  const auto [cos, sin] = llama::precompute_rope(args.qk_rope_head_dim, kSeq, args.rope_theta);
  const at::Tensor x = at::randn({kBatch, kSeq, args.dim}, gen).requires_grad_(true);
  c10::AutoGradMode grad(true);
  const int64_t before = tensor_memory::live_bytes();
  at::Tensor out = block->forward(x, cos, sin);
  const int64_t after = tensor_memory::live_bytes();
  // As above: the output is the next block's, the float32 input saved by the first norm this block's.
  const int64_t saved = after - before - static_cast<int64_t>(out.nbytes()) + static_cast<int64_t>(x.nbytes());
  if (block->moe) {
    EXPECT_EQ(block->moe->tokens_per_expert().sum().item<int64_t>(), kBatch * kSeq * args.moe_options().top_k);
  }
  out = at::Tensor();
  EXPECT_EQ(tensor_memory::live_bytes(), before);
  return saved;
}

}  // namespace

TEST(PlanMoEMemory, DeepSeekV3BlocksSavedActivations) {
  namespace ds = fsdp::models::deepseek_v3;
  const ds::DeepSeekV3Args args = ds::deepseek_v3_flavor("cpu_tiny");
  ASSERT_FALSE(args.is_moe_layer(0));
  ASSERT_TRUE(args.is_moe_layer(1));
  ASSERT_NE(args.qk_head_dim(), args.v_head_dim);  // the CPU math path below
  ASSERT_GT(args.q_lora_rank, 0);
  PlanConfig c;
  set_model(c, "deepseek_v3", "cpu_tiny");
  c.local_batch = kBatch;
  c.seq_len = kSeq;
  const Plan p = make_plan(c);
  const int64_t T = kBatch * kSeq, H = args.n_heads;
  const int64_t cpu_math_path = T * (4 * H * kSeq - 4 * H), rsqrt = T * 4 * 4;
  // Within 0.01%: the MoE block saves 32 bytes more (8 floats: one [E] tensor of its router's), nothing else is left.
  expect_close(p.memory.act_per_dense_layer + cpu_math_path + rsqrt, measured_saved_deepseek_v3(args, 0), 1e-4,
               "deepseek_v3 cpu_tiny dense block (MLA) + the CPU math kernel, Float");
  expect_close(p.memory.act_per_moe_layer + cpu_math_path + rsqrt, measured_saved_deepseek_v3(args, 1), 1e-4,
               "deepseek_v3 cpu_tiny MoE block (MLA, shared expert, group-limited routing) + the CPU math kernel, Float");
}
