// See parallelize_deepseek_v3.h.
#include "parallelize_deepseek_v3.h"

#include "moe_overrides.h"
#include "pipeline_deepseek_v3.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/models/deepseek_v3_pipeline.h>
#include <fsdp/models/deepseek_v3_tp_plan.h>
#include <fsdp/models/moe.h>
#include <fsdp/tensor_parallel.h>

#include <c10/util/Exception.h>

#include <memory>
#include <vector>

namespace fsdp_train::deepseek_v3 {
namespace {

namespace ds = fsdp::models::deepseek_v3;

std::string family_and_flavor(const JobConfig& config) { return "deepseek_v3 " + config.model.flavor; }

// Activation checkpointing of every block (before fully_shard: TorchTitan's order); what it applied, for the log.
std::string apply_ac(ds::DeepSeekV3& model, AcMode mode, const SelectiveAcOption& option) {
  if (mode == AcMode::None) return "no activation checkpointing";
  const std::vector<std::shared_ptr<torch::nn::Module>> blocks = block_modules(model->blocks());
  if (mode == AcMode::Selective && option.kind == SelectiveAcOption::Kind::Op) {
    // The MoE layers count their tokens in the first pass only (op SAC runs both passes with gradients).
    fsdp::checkpoint_every_kth(blocks, 1, {fsdp::CheckpointPolicy::SelectiveOp});
    return "op-level selective activation checkpointing (every 2nd matmul kept)";
  }
  const int64_t k = mode == AcMode::Full ? 1 : option.k;
  const size_t n = fsdp::checkpoint_every_kth(blocks, k);
  if (mode == AcMode::Full) return "full activation checkpointing (every block)";
  return "layer-selective activation checkpointing (every " + std::to_string(k <= 1 ? 1 : k) + " blocks: " +
         std::to_string(n) + " of " + std::to_string(blocks.size()) + ")";
}

// TorchTitan's DeepSeek-V3 TP plan (sequence parallel, MLA split by heads) over the 1-D `tp_mesh`; loss_parallel:
// the output projection keeps its logits sharded over the vocabulary.
void apply_tp(ds::DeepSeekV3& model, const fsdp::DeviceMesh& tp_mesh, bool loss_parallel) {
  fsdp::parallelize_module(model, tp_mesh, ds::tensor_parallel_plan(model->args(), tp_mesh.size(), loss_parallel));
}

// Context parallelism (TorchTitan's apply_cp) on the whole model or a pipeline stage (`holder`: DeepSeekV3Impl or
// DeepSeekV3StageImpl): the RoPE positions and document mask every family shares (parallelize.h: cp_hooks), and
// every block's MLA through the ring over the cp ranks: q and k of qk_nope + qk_rope, v of v_head_dim (the ring
// pads v, context_parallel.h), at MLA's own softmax scale (YaRN's mscale; the ring's default 1/sqrt(qk head dim)
// would differ).
template <class Holder>
void cp_attention(Holder& holder, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
                  CpLoadBalancer load_balancer) {
  const CpHooks hooks = cp_hooks(cp_mesh, rotate_method, load_balancer);
  hooks.install(holder);
  for (auto& block : holder.blocks()) block->attention->kernel = hooks.ring_attention(block->attention->softmax_scale);
}

void apply_cp(ds::DeepSeekV3& model, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer) {
  cp_attention(*model, cp_mesh, rotate_method, load_balancer);
}

// The routed experts of every MoE block split over the 1-D `ep_mesh` (collective-free; before fully_shard).
void apply_ep(ds::DeepSeekV3& model, const fsdp::DeviceMesh& ep_mesh) {
  for (auto& block : model->blocks()) {
    if (block->moe) fsdp::apply_expert_parallel(block->moe->experts.ptr(), ep_mesh);
  }
}

}  // namespace

void apply_tp(ds::DeepSeekV3Stage& stage, const ds::DeepSeekV3Args& args, const fsdp::DeviceMesh& tp_mesh,
              bool loss_parallel) {
  // The whole model's plan without the entries of modules this stage does not hold.
  fsdp::parallelize_module(stage, tp_mesh,
                           ds::tensor_parallel_plan(args, tp_mesh.size(), loss_parallel, stage->first(),
                                                    stage->begin(), stage->end(), stage->last()));
  stage->sequence_shards = tp_mesh.size();  // hidden states travel between stages split on the sequence
}

void apply_cp(ds::DeepSeekV3Stage& stage, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer) {
  cp_attention(*stage, cp_mesh, rotate_method, load_balancer);
}

std::string tp_description(const ParallelPlan& plan) {
  return "TP " + std::to_string(plan.tp_mesh.size()) + " (sequence parallel, MLA heads split, " +
         (plan.loss_parallel ? "loss parallel" : "logits gathered") + ") + ";
}

std::vector<std::shared_ptr<torch::nn::Module>> block_modules(std::vector<ds::TransformerBlock>& blocks) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& b : blocks) out.push_back(b.ptr());
  return out;
}

std::shared_ptr<torch::nn::Module> experts_of_block(torch::nn::Module& block) {
  auto* b = dynamic_cast<ds::TransformerBlockImpl*>(&block);
  return b && b->moe ? b->moe->experts.ptr() : nullptr;
}

ds::DeepSeekV3Args model_args(const JobConfig& config) {
  const auto& m = config.model;
  ds::DeepSeekV3Args args;
  try {
    args = ds::deepseek_v3_flavor(m.flavor);
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("config error: model.flavor: ") + e.what_without_backtrace());
  }
  args.attn_mask_type = m.attn_mask_type == AttnMaskType::BlockCausal ? fsdp::models::llama::AttnMaskType::BlockCausal
                                                                    : fsdp::models::llama::AttnMaskType::Causal;
  apply_moe_overrides(m, args.moe);
  // The trainer adds the sequence aux loss when the key is set (> 0); the flavor's own coefficient would compute
  // a loss nothing adds.
  if (m.moe_sequence_aux_loss_coeff <= 0) args.moe.sequence_aux_loss_coeff.reset();
  return args;
}

void check_layout(const ds::DeepSeekV3Args& args, const JobConfig& config, const ParallelDims& dims) {
  const std::string model = family_and_flavor(config);
  if (dims.tp > 1 && args.n_heads % dims.tp != 0) {
    throw ConfigError("config error: parallelism.tensor_parallel_degree = " + std::to_string(dims.tp) +
                      " does not divide the " + std::to_string(args.n_heads) + " attention heads of " + model);
  }
  const auto& ac = config.activation_checkpoint;
  if (ac.mode == AcMode::Selective && ac.selective_ac_option.kind != SelectiveAcOption::Kind::EveryKth &&
      ac.selective_ac_option.kind != SelectiveAcOption::Kind::Op) {
    throw ConfigError("config error: activation_checkpoint.selective_ac_option: expected \"op\" or an integer k, got \"" +
                      ac.selective_ac_option.unparsed + "\"");
  }
  if (args.moe.num_experts % dims.ep != 0) {
    throw ConfigError("config error: parallelism.expert_parallel_degree = " + std::to_string(dims.ep) +
                      " does not divide the " + std::to_string(args.moe.num_experts) + " experts of " + model);
  }
}

ParallelPlan parallelize_deepseek_v3(ds::DeepSeekV3& model, const JobConfig& config, const ParallelDims& dims,
                                     const fsdp::ProcessGroupPtr& group) {
  check_layout(model->args(), config, dims);
  ParallelPlan plan;
  plan.dp_group = group;
  plan.activation_checkpointing =
      apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option);
  if (!group) {
    plan.description = "single process (no process group: run under fsdprun to apply fully_shard)";
    return plan;
  }
  if (dims.pp > 1) return parallelize_deepseek_v3_pipeline(model, config, dims, group, std::move(plan));
  const ParallelMeshes meshes = build_meshes(dims, mesh_device(config).is_cuda() ? "cuda" : "cpu", /*moe=*/true);
  plan.mesh = meshes.world;
  if (plain_data_parallel(dims)) {
    plan.fsdp_modules = replicate_blocks_then_root(block_modules(model->blocks()), model.ptr(), plan.mesh);
    plan.description = "data parallel (replicate " + std::to_string(dims.dp_replicate) +
                       ", fsdp::replicate: gradient all-reduce per block)";
  } else {
    std::string parallel_description;
    if (dims.tp > 1) {
      plan.tp_mesh = meshes.tp;
      plan.loss_parallel = !config.parallelism.disable_loss_parallel;
      apply_tp(model, plan.tp_mesh, plan.loss_parallel);
      parallel_description = tp_description(plan);
    }
    if (dims.cp > 1) {
      const auto& p = config.parallelism;
      plan.cp_mesh = meshes.cp;
      plan.fsdp_mesh = meshes.dp;  // dp_shard_cp
      apply_cp(model, plan.cp_mesh, p.context_parallel_rotate_method, p.context_parallel_load_balancer);
      parallel_description += cp_description(config, dims);
    }
    set_moe_sequence_group(block_modules(model->blocks()), meshes);  // tp, cp or cp x tp: moe_sequence_mesh
    // The routed experts' placement (TorchTitan's apply_moe_ep + apply_fsdp): over the ranks left after ep of
    // dp_shard x tp (efsdp); under TP without EP over dp_shard x tp (each TP rank routes its own tokens; no expert
    // tensor parallel). Shard(1) when the experts would be cut in more pieces than there are (tt#1561).
    const int64_t num_experts = model->args().moe.num_experts;
    FsdpOptions fsdp = fsdp_options(config, meshes.dp, /*pipeline=*/false);
    fsdp.experts_shard_dim = dims.dp_shard * dims.cp * dims.tp > num_experts ? 1 : 0;
    std::string experts_description = parallel_description;
    if (dims.ep > 1) {
      apply_ep(model, meshes.ep);
      fsdp.experts_mesh = meshes.expert_dp;
      experts_description += "EP " + std::to_string(dims.ep) + " (experts' FSDP over " + fsdp.experts_mesh.to_string() +
                             ", Shard(" + std::to_string(fsdp.experts_shard_dim) + ")) + ";
    } else if (dims.tp > 1) {
      fsdp.experts_mesh = meshes.expert_dp;
      experts_description += "experts' FSDP over " + fsdp.experts_mesh.to_string() + ", Shard(" +
                             std::to_string(fsdp.experts_shard_dim) + ") + ";
    } else if (fsdp.experts_shard_dim == 1) {
      experts_description += "experts Shard(1) + ";
    }
    plan.fsdp_modules =
        fully_shard_blocks_then_root(block_modules(model->blocks()), model.ptr(), fsdp, experts_of_block);
    plan.description = experts_description + std::string(dims.dp_replicate > 1 ? "HSDP" : "FSDP") + " mesh " +
                       (plan.fsdp_mesh.valid() ? plan.fsdp_mesh : plan.mesh).to_string() + ", reshard_after_forward " +
                       to_string(config.parallelism.fsdp_reshard_after_forward) + ", param " +
                       to_string(config.training.mixed_precision_param) + ", reduce " +
                       to_string(config.training.mixed_precision_reduce);
  }
  set_sum_gradients(plan);
  return plan;
}

}  // namespace fsdp_train::deepseek_v3
