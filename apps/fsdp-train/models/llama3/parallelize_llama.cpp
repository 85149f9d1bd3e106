// See parallelize_llama.h.
#include "parallelize_llama.h"

#include "moe_overrides.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/models/moe.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

#include <optional>

namespace fsdp_train::llama3 {
namespace {

// The MoE block of a transformer block, or null for a dense one (its feed-forward is a child named "moe").
fsdp::models::moe::MoEImpl* moe_of(torch::nn::Module& block) {
  for (const auto& child : block.named_children()) {
    if (child.key() == "moe") return child.value()->as<fsdp::models::moe::MoEImpl>();
  }
  return nullptr;
}

// The routed experts per MoE block (0: a dense model).
int64_t num_experts_of(fsdp::models::llama::Transformer& model) {
  int64_t n = 0;
  for (auto& block : model->blocks()) {
    if (auto* moe = moe_of(*block)) n = moe->options().num_experts;
  }
  return n;
}

// The routed experts of a transformer block (null: a dense block), for the experts' FSDP placement.
std::shared_ptr<torch::nn::Module> experts_of_block(torch::nn::Module& block) {
  auto* moe = moe_of(block);
  return moe ? moe->experts.ptr() : nullptr;
}

template <class Blocks>
std::vector<std::shared_ptr<torch::nn::Module>> module_ptrs(Blocks& blocks) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& b : blocks) out.push_back(b.ptr());
  return out;
}

// The layer index of a TP-plan pattern naming one layer ("layers.3.moe.router.gate" -> 3); none for a wildcard
// ("layers.*.attention") or a root module.
std::optional<int64_t> named_layer(const std::string& pattern) {
  static const std::string prefix = "layers.";
  if (pattern.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t end = pattern.find('.', prefix.size());
  const std::string index =
      pattern.substr(prefix.size(), end == std::string::npos ? std::string::npos : end - prefix.size());
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(index);
}

}  // namespace

fsdp::models::llama::LlamaArgs model_args(const JobConfig& config) {
  const auto& m = config.model;
  fsdp::models::llama::LlamaArgs args;
  try {
    args = fsdp::models::llama::model_flavor(m.name, m.flavor);
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("config error: model.flavor: ") + e.what_without_backtrace());
  }
  args.attn_mask_type = m.attn_mask_type == AttnMaskType::BlockCausal ? fsdp::models::llama::AttnMaskType::BlockCausal
                                                                    : fsdp::models::llama::AttnMaskType::Causal;
  const bool overrides = m.moe_score_func != MoeScoreFunc::FlavorDefault || m.moe_shared_experts >= 0 ||
                         m.moe_route_norm != MoeRouteNorm::FlavorDefault ||
                         m.moe_route_scale != 0 || m.moe_load_balance_coeff >= 0 || m.moe_sequence_aux_loss_coeff > 0 ||
                         m.moe_num_expert_groups > 0;
  if (!overrides) return args;
  if (!args.moe) {
    throw ConfigError("config error: model.moe_* keys set, but " + m.name + " " + m.flavor +
                      " has no MoE layers (use a *_moe flavor)");
  }
  apply_moe_overrides(m, *args.moe);
  return args;
}

std::string apply_ac(fsdp::models::llama::Transformer& model, AcMode mode, const SelectiveAcOption& option) {
  if (mode == AcMode::None) return "no activation checkpointing";
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (auto& b : model->blocks()) blocks.push_back(b.ptr());
  if (mode == AcMode::Full) {
    fsdp::checkpoint_every_kth(blocks, 1);
    return "full activation checkpointing (every block)";
  }
  if (option.kind == SelectiveAcOption::Kind::Op) {
    fsdp::checkpoint_every_kth(blocks, 1, {fsdp::CheckpointPolicy::SelectiveOp});
    return "op-level selective activation checkpointing (every 2nd matmul kept)";
  }
  TORCH_CHECK(option.kind == SelectiveAcOption::Kind::EveryKth,
              "activation_checkpoint.selective_ac_option: expected \"op\" or an integer k, got \"", option.unparsed, "\"");
  const int64_t k = option.k;
  const size_t n = fsdp::checkpoint_every_kth(blocks, k);
  return "layer-selective activation checkpointing (every " + std::to_string(k <= 1 ? 1 : k) + " blocks: " +
         std::to_string(n) + " of " + std::to_string(blocks.size()) + ")";
}

void apply_tp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& tp_mesh, bool loss_parallel) {
  fsdp::parallelize_module(model, tp_mesh,
                           fsdp::models::llama::tensor_parallel_plan(model->args(), tp_mesh.size(), {true, loss_parallel}));
}

void apply_tp(fsdp::models::llama::LlamaStage& stage, const fsdp::models::llama::LlamaArgs& args,
              const fsdp::DeviceMesh& tp_mesh, bool loss_parallel) {
  // TorchTitan's Llama TP plan without the entries for modules this stage does not hold.
  fsdp::ParallelizePlan kept;
  for (auto& entry : fsdp::models::llama::tensor_parallel_plan(args, tp_mesh.size(), {true, loss_parallel})) {
    const std::string& pattern = entry.first;
    if (pattern == "tok_embeddings" && !stage->first()) continue;
    if ((pattern == "norm" || pattern == "output") && !stage->last()) continue;
    if (pattern.rfind("layers.", 0) == 0 && stage->begin() == stage->end()) continue;
    // MoE models name each layer's entries (router, shared experts, a dense layer's feed-forward): the stage
    // keeps those of its own layers (its layers keep the whole model's indices).
    const auto layer = named_layer(pattern);
    if (layer && (*layer < stage->begin() || *layer >= stage->end())) continue;
    kept.push_back(std::move(entry));
  }
  fsdp::parallelize_module(stage, tp_mesh, kept);
  stage->sequence_shards = tp_mesh.size();  // the plan is sequence parallel: hidden states travel split on the sequence
}

namespace {

// apply_cp's blocks (TorchTitan's apply_cp): every given block's attention through ring attention over the cp
// group at the ring's default scale (1/sqrt(head dim), Llama's). (The MoE blocks' sequence group is set once after
// the apply_* steps: moe_sequence_mesh.)
void cp_attention(std::vector<fsdp::models::llama::TransformerBlock>& blocks, const fsdp::DeviceMesh& cp_mesh,
                  const CpHooks& hooks) {
  for (auto& block : blocks) block->attention->kernel = hooks.ring_attention();
}

}  // namespace

void apply_cp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer) {
  const CpHooks hooks = cp_hooks(cp_mesh, rotate_method, load_balancer);
  cp_attention(model->blocks(), cp_mesh, hooks);
  hooks.install(*model);
}

void apply_cp(fsdp::models::llama::LlamaStage& stage, const fsdp::DeviceMesh& cp_mesh, CpRotateMethod rotate_method,
              CpLoadBalancer load_balancer) {
  const CpHooks hooks = cp_hooks(cp_mesh, rotate_method, load_balancer);
  cp_attention(stage->blocks(), cp_mesh, hooks);
  hooks.install(*stage);
}

void apply_ep(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& ep_mesh) {
  for (auto& block : model->blocks()) {
    if (auto* moe = moe_of(*block)) fsdp::apply_expert_parallel(moe->experts.ptr(), ep_mesh);
  }
}

std::vector<fsdp::FSDPModule> apply_fsdp(fsdp::models::llama::Transformer& model, const FsdpOptions& options) {
  return fully_shard_blocks_then_root(module_ptrs(model->blocks()), model.ptr(), options, experts_of_block);
}

std::vector<fsdp::FSDPModule> apply_fsdp(fsdp::models::llama::LlamaStage& stage, const FsdpOptions& options) {
  return fully_shard_blocks_then_root(module_ptrs(stage->blocks()), stage.ptr(), options, experts_of_block);
}

std::vector<fsdp::FSDPModule> apply_ddp(fsdp::models::llama::Transformer& model, const fsdp::DeviceMesh& mesh) {
  return replicate_blocks_then_root(module_ptrs(model->blocks()), model.ptr(), mesh);
}

PipelineSplit split_pipeline(const fsdp::models::llama::LlamaArgs& args, const PipelineSplitOptions& o) {
  // Stages: TorchTitan's split, placed by the schedule (loop or V).
  const auto kind = o.schedule_csv.empty() ? o.schedule : fsdp::pipeline::ScheduleKind::Csv;
  const int64_t n_layers = args.n_layers;
  PipelineSplit split;
  split.num_stages = o.pp * fsdp::pipeline::default_stages_per_rank(kind);
  const bool explicit_fqns = !o.module_fqns_per_model_part.empty();
  if (explicit_fqns) {
    split.num_stages = static_cast<int64_t>(o.module_fqns_per_model_part.size());
    if (split.num_stages % o.pp != 0) {
      throw ConfigError("config error: parallelism.module_fqns_per_model_part lists " +
                        std::to_string(split.num_stages) + " stages, not a multiple of pipeline_parallel_degree = " +
                        std::to_string(o.pp));
    }
  } else if (o.layers_per_stage > 0) {
    split.num_stages = fsdp::models::llama::stages_for_layers_per_stage(n_layers, o.layers_per_stage,
                                                                    o.first_stage_less_layers, o.last_stage_less_layers);
    if (split.num_stages % o.pp != 0) {
      throw ConfigError("config error: parallelism.pipeline_parallel_layers_per_stage = " +
                        std::to_string(o.layers_per_stage) + " gives " + std::to_string(split.num_stages) +
                        " stages for " + std::to_string(n_layers) + " layers, not a multiple of "
                        "pipeline_parallel_degree = " + std::to_string(o.pp));
    }
  }
  try {
    split.layers = explicit_fqns ? fsdp::models::llama::layers_from_fqns(args, o.module_fqns_per_model_part)
                                 : fsdp::models::llama::split_layers(n_layers, split.num_stages, o.first_stage_less_layers,
                                                                 o.last_stage_less_layers);
    split.schedule = o.schedule_csv.empty()
                         ? fsdp::pipeline::build_schedule({kind, static_cast<int>(o.pp),
                                                           static_cast<int>(split.num_stages / o.pp),
                                                           static_cast<int>(o.microbatches)})
                         : fsdp::pipeline::load_schedule_csv(o.schedule_csv, static_cast<int>(o.pp),
                                                             static_cast<int>(split.num_stages),
                                                             static_cast<int>(o.microbatches));
  } catch (const c10::Error& e) {
    throw ConfigError(std::string(o.schedule_csv.empty() ? "config error: parallelism: "
                                                         : "config error: parallelism.pipeline_parallel_schedule_csv: ") +
                      e.what_without_backtrace());
  }
  return split;
}

namespace {

ParallelPlan parallelize_llama_pipeline(fsdp::models::llama::Transformer& model, const JobConfig& config,
                                        const ParallelDims& dims, const fsdp::ProcessGroupPtr& group) {
  ParallelPlan plan;
  plan.dp_group = group;
  plan.activation_checkpointing =
      apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option);
  TORCH_CHECK(group, "pipeline parallelism needs a process group (run under fsdprun)");
  const PipelineSplit split = split_pipeline(model->args(), pipeline_split_options(config, dims));
  const ParallelMeshes meshes = start_pipeline_plan(plan, config, dims, /*moe=*/num_experts_of(model) > 0, split);
  const int64_t num_stages = split.num_stages;
  const auto& p = config.parallelism;
  FsdpOptions fsdp = fsdp_options(config, meshes.dp, /*pipeline=*/true);
  const std::string experts_description =
      pipeline_moe_setup(plan, fsdp, num_experts_of(model), config, dims, meshes);
  std::string layers;
  for (int s : plan.stage_indices) {
    const auto [begin, end] = split.layers[static_cast<size_t>(s)];
    fsdp::models::llama::LlamaStage stage(*model, begin, end, s == 0, s == num_stages - 1);
    if (dims.tp > 1) apply_tp(stage, model->args(), plan.tp_mesh, plan.loss_parallel);
    if (dims.cp > 1) apply_cp(stage, plan.cp_mesh, p.context_parallel_rotate_method, p.context_parallel_load_balancer);
    set_moe_sequence_group(module_ptrs(stage->blocks()), meshes);  // tp, cp or cp x tp: moe_sequence_mesh
    if (dims.ep > 1) {
      for (auto& block : stage->blocks()) {
        if (auto* moe = moe_of(*block)) fsdp::apply_expert_parallel(moe->experts.ptr(), meshes.ep);
      }
    }
    for (auto& m : apply_fsdp(stage, fsdp)) plan.fsdp_modules.push_back(m);
    layers += (layers.empty() ? "" : ", ") + stage_layers_text(s, begin, end, plan.num_stages);
    plan.stages.push_back(pipeline_stage(stage.ptr(), stage_call(stage), plan, dims));
  }
  finish_pipeline_plan(plan, config, dims, layers,
                       (dims.tp > 1 ? "TP " + std::to_string(dims.tp) + " (sequence parallel) + " : std::string()) +
                           cp_description(config, dims) + experts_description);
  return plan;
}

}  // namespace

void check_layout(const std::string& family, const fsdp::models::llama::LlamaArgs& args, const JobConfig& config,
                  const ParallelDims& dims) {
  const int64_t num_experts = args.moe ? args.moe->num_experts : 0;
  const bool has_moe = num_experts > 0;
  const std::string model = family + " " + config.model.flavor;
  if (dims.ep > 1 && !has_moe) {
    throw ConfigError("config error: parallelism.expert_parallel_degree = " + std::to_string(dims.ep) + " but " +
                      model + " has no MoE layers (use a *_moe flavor)");
  }
  if (has_moe && num_experts % dims.ep != 0) {
    throw ConfigError("config error: parallelism.expert_parallel_degree = " + std::to_string(dims.ep) +
                      " does not divide the " + std::to_string(num_experts) + " experts of " + model);
  }
}

ParallelPlan parallelize_llama(fsdp::models::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group) {
  check_layout(config.model.name, model->args(), config, dims);
  const int64_t num_experts = num_experts_of(model);
  const bool has_moe = num_experts > 0;
  const auto& ac = config.activation_checkpoint;
  if (dims.pp > 1) return parallelize_llama_pipeline(model, config, dims, group);
  ParallelPlan plan;
  plan.dp_group = group;
  const std::string device = mesh_device(config).is_cuda() ? "cuda" : "cpu";  // init_device_mesh takes the type
  plan.activation_checkpointing = apply_ac(model, ac.mode, ac.selective_ac_option);
  if (!group) {
    // fully_shard needs a process group (even a 1-rank one, as under fsdprun); a bare process trains unsharded.
    plan.description = "single process (no process group: run under fsdprun to apply fully_shard)";
    return plan;
  }
  const ParallelMeshes meshes = build_meshes(dims, device, has_moe);
  plan.mesh = meshes.world;
  if (plain_data_parallel(dims)) {
    // TorchTitan's DDP path, in FSDP2's style (fsdp::replicate). Full precision, as TorchTitan's DDP: the
    // mixed_precision_* keys apply to FSDP.
    plan.fsdp_modules = apply_ddp(model, plan.mesh);
    set_sum_gradients(plan);
    plan.description = "data parallel (replicate " + std::to_string(dims.dp_replicate) +
                       ", fsdp::replicate: gradient all-reduce per block)";
    return plan;
  }
  std::string tp_description;
  if (dims.tp > 1) {
    plan.tp_mesh = meshes.tp;
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
    apply_tp(model, plan.tp_mesh, plan.loss_parallel);
    tp_description = "TP " + std::to_string(dims.tp) + " (sequence parallel, " +
                     (plan.loss_parallel ? "loss parallel" : "logits gathered") + ") + ";
  }
  if (dims.cp > 1) {
    const auto& p = config.parallelism;
    plan.cp_mesh = meshes.cp;
    plan.fsdp_mesh = meshes.dp;
    apply_cp(model, plan.cp_mesh, p.context_parallel_rotate_method, p.context_parallel_load_balancer);
    tp_description += cp_description(config, dims);
  }
  set_moe_sequence_group(module_ptrs(model->blocks()), meshes);  // tp, cp or cp x tp: moe_sequence_mesh
  FsdpOptions fsdp = fsdp_options(config, meshes.dp, /*pipeline=*/false);
  std::string experts_description;
  if (has_moe) {
    // Where the routed experts are sharded (TorchTitan's apply_moe_ep + apply_fsdp): with expert parallelism over
    // the ranks left after ep of dp_shard x cp x tp (efsdp); without it, over the dense mesh (dp_shard_cp under
    // CP), or under TP over dp_shard x cp x tp (each CP and TP rank routes its own tokens: the experts are not
    // tensor-parallel, TorchTitan removed ETP). Shard(1) instead of Shard(0) when the expert weights would be cut
    // in more pieces (efsdp x ep = dp_shard x cp x tp) than there are experts (tt#1561: dim-0 shards would be
    // mostly padding; the count excludes dp_replicate, tt#4767).
    fsdp.experts_shard_dim = dims.dp_shard * dims.cp * dims.tp > num_experts ? 1 : 0;
    if (dims.ep > 1) {
      apply_ep(model, meshes.ep);
      fsdp.experts_mesh = meshes.expert_dp;
      experts_description = "EP " + std::to_string(dims.ep) + " (experts' FSDP over " + fsdp.experts_mesh.to_string() +
                            ", Shard(" + std::to_string(fsdp.experts_shard_dim) + ")) + ";
    } else if (dims.tp > 1) {
      fsdp.experts_mesh = meshes.expert_dp;
      experts_description = "experts' FSDP over " + fsdp.experts_mesh.to_string() + ", Shard(" +
                            std::to_string(fsdp.experts_shard_dim) + ") + ";
    } else if (fsdp.experts_shard_dim == 1) {
      experts_description = "experts Shard(1) + ";
    }
  }
  plan.fsdp_modules = apply_fsdp(model, fsdp);
  set_sum_gradients(plan);
  plan.description = tp_description + experts_description + std::string(dims.dp_replicate > 1 ? "HSDP" : "FSDP") +
                     " mesh " + (plan.fsdp_mesh.valid() ? plan.fsdp_mesh : plan.mesh).to_string() +
                     ", reshard_after_forward " +
                     to_string(config.parallelism.fsdp_reshard_after_forward) + ", param " +
                     to_string(config.training.mixed_precision_param) + ", reduce " +
                     to_string(config.training.mixed_precision_reduce);
  return plan;
}

}  // namespace fsdp_train::llama3
