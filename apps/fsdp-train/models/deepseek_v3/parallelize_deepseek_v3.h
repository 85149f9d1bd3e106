#pragma once
// DeepSeek-V3's parallelize step (torchtitan/models/deepseek_v3/infra/parallelize.py), reached through the model
// seam (model_spec.h). TorchTitan's order, one apply_* per parallelism:
//   apply_ac    [activation_checkpoint] on every block: full, every k-th block, op-level SAC (the MoE layers count
//               their tokens in the first pass only)
//   apply_tp    tensor_parallel_degree > 1: TorchTitan's DeepSeek-V3 plan (<fsdp/models/deepseek_v3_tp_plan.h>:
//               sequence parallel, MLA split by heads, the low-rank projections replicated; router replicated,
//               shared experts col/row); the routed experts' FSDP (or EP) then spans dp_shard x tp
//   apply_cp    context_parallel_degree > 1: every block's MLA through ring attention over "cp" at MLA's softmax
//               scale (v's head dim differs from q/k's: the ring pads it), RoPE at the chunks' global positions,
//               block_causal by the masked ring (the hooks every family shares: parallelize.h, cp_hooks); FSDP
//               over dp_shard x cp (TorchTitan's dp_shard_cp)
//   apply_ep    expert_parallel_degree > 1: each MoE block's routed experts split over "ep", borrowed from the
//               data-parallel shard dim (the experts' FSDP over what is left, [dp_replicate,] efsdp)
//   apply_fsdp  fully_shard on every block, then on the root (FSDP or HSDP; per-block reshard as TorchTitan), the
//               routed experts on their own mesh and shard dim; or fsdp::replicate (TorchTitan's DDP path) with
//               dp_shard 1; both through the wrapping every family shares (parallelize.h)
//   pipeline   pipeline_parallel_degree > 1: the stages split as Llama's (pipeline_deepseek_v3.h), TP (the stage's
//              layers' plan entries), CP (the stage's RoPE positions, document mask and MLA ring), EP and FSDP in
//              each stage this rank holds
// Under TP, CP or both each MoE block sums its per-sequence expert counts for the sequence balance loss over the
// ranks splitting a sequence (moe_sequence_mesh, parallelize.h: set once, after the apply_* steps).
// Refused with a ConfigError naming the family, the flavor and the layout (check_layout): a TP degree not
// dividing the heads, an EP degree not dividing the experts. Hugging Face load/save (checkpoint.*_in_hf) runs in
// every layout accepted (the adapter's sharded path: one tensor gathered at a time, each rank reading its own rows).

#include "config.h"
#include "parallel_dims.h"
#include "parallelize.h"

#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/deepseek_v3_pipeline.h>
#include <fsdp/process_group.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp_train::deepseek_v3 {

// model.flavor with the [model] attn_mask_type and moe_* overrides applied; a ConfigError for an unknown flavor.
// moe_sequence_aux_loss_coeff = 0 turns the flavor's sequence aux loss off (the key's "0 = off": the trainer
// adds the loss only when the key is set).
fsdp::models::deepseek_v3::DeepSeekV3Args model_args(const JobConfig& config);

// The layouts the family trains (no collectives): a ConfigError naming deepseek_v3, the flavor and the refused
// layout.
void check_layout(const fsdp::models::deepseek_v3::DeepSeekV3Args& args, const JobConfig& config,
                  const ParallelDims& dims);

// The blocks as modules, and a block's routed experts (null: a dense block): what the shared FSDP / DDP wrapping
// takes (parallelize.h: fully_shard_blocks_then_root, replicate_blocks_then_root).
std::vector<std::shared_ptr<torch::nn::Module>> block_modules(std::vector<fsdp::models::deepseek_v3::TransformerBlock>& blocks);
std::shared_ptr<torch::nn::Module> experts_of_block(torch::nn::Module& block);

// TorchTitan's DeepSeek-V3 TP plan for a pipeline stage (only the entries of the modules it holds) over the 1-D
// `tp_mesh`; the stage's hidden states then travel split on the sequence.
void apply_tp(fsdp::models::deepseek_v3::DeepSeekV3Stage& stage, const fsdp::models::deepseek_v3::DeepSeekV3Args& args,
              const fsdp::DeviceMesh& tp_mesh, bool loss_parallel);
// Context parallelism in a pipeline stage (as the whole model's apply_cp, after apply_tp): the stage's RoPE
// positions and document mask for this rank's chunks, and its blocks' MLA through ring attention over the 1-D
// `cp_mesh` at MLA's softmax scale, on the chunks the previous stage passed on. Collective-free.
void apply_cp(fsdp::models::deepseek_v3::DeepSeekV3Stage& stage, const fsdp::DeviceMesh& cp_mesh,
              CpRotateMethod rotate_method, CpLoadBalancer load_balancer);
// "TP <n> (sequence parallel, MLA heads split, loss parallel | logits gathered) + ", for the plan's description.
std::string tp_description(const ParallelPlan& plan);

// check_layout first; `group`: the world group, or null for one process (then only AC).
ParallelPlan parallelize_deepseek_v3(fsdp::models::deepseek_v3::DeepSeekV3& model, const JobConfig& config,
                                     const ParallelDims& dims, const fsdp::ProcessGroupPtr& group);

}  // namespace fsdp_train::deepseek_v3
