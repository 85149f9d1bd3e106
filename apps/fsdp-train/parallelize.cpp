// See parallelize.h.
#include "parallelize.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/models/moe.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/pipeline/schedule.h>
#include <fsdp/replicate.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

#include <unordered_set>

namespace fsdp_train {
namespace {

c10::ScalarType dtype_of(MixedPrecision p) { return p == MixedPrecision::BFloat16 ? c10::kBFloat16 : c10::kFloat; }

// [activation_checkpoint] on every transformer block, before fully_shard (TorchTitan's order: AC wrap, then FSDP).
std::string apply_activation_checkpointing(fsdp::nn::llama::Transformer& model, const JobConfig& config) {
  const auto& ac = config.activation_checkpoint;
  if (ac.mode == AcMode::None) return "no activation checkpointing";
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (auto& b : model->blocks()) blocks.push_back(b.ptr());
  if (ac.mode == AcMode::Full) {
    fsdp::checkpoint_every_kth(blocks, 1);
    return "full activation checkpointing (every block)";
  }
  if (ac.selective_ac_option.kind == SelectiveAcOption::Kind::Op) {
    fsdp::checkpoint_every_kth(blocks, 1, {fsdp::CheckpointPolicy::SelectiveOp});
    return "op-level selective activation checkpointing (every 2nd matmul kept)";
  }
  const int64_t k = ac.selective_ac_option.k;  // Kind::EveryKth: validate() refuses an unparsed option
  const size_t n = fsdp::checkpoint_every_kth(blocks, k);
  return "layer-selective activation checkpointing (every " + std::to_string(k <= 1 ? 1 : k) + " blocks: " +
         std::to_string(n) + " of " + std::to_string(blocks.size()) + ")";
}

// The MoE block of a transformer block, or null for a dense one (its feed-forward is a child named "moe").
fsdp::nn::moe::MoEImpl* moe_of(torch::nn::Module& block) {
  for (const auto& child : block.named_children()) {
    if (child.key() == "moe") return child.value()->as<fsdp::nn::moe::MoEImpl>();
  }
  return nullptr;
}

// Where a block's routed experts are sharded (TorchTitan's apply_moe_ep + apply_fsdp): with expert parallelism
// the experts are split over `ep` ranks first and FSDP shards each rank's experts over the data-parallel ranks
// left (mesh [dp_replicate,] efsdp); without it, over the dense mesh. Shard(1) instead of Shard(0) when the
// expert weights would be cut in more pieces (efsdp x ep = dp_shard) than there are experts (tt#1561: dim-0
// shards would be mostly padding; the count excludes dp_replicate, tt#4767).
struct ExpertSharding {
  fsdp::DeviceMesh mesh;  // invalid: the block's own (dense) mesh
  int64_t dim = 0;
  std::string description;
};

ExpertSharding apply_expert_parallel_to_blocks(fsdp::nn::llama::Transformer& model, const ParallelDims& dims,
                                               const std::string& device) {
  ExpertSharding out;
  int64_t num_experts = 0;
  for (auto& block : model->blocks()) {
    if (auto* moe = moe_of(*block)) num_experts = moe->options().num_experts;
  }
  if (num_experts == 0) {
    if (dims.ep > 1) {
      throw ConfigError("config error: parallelism.expert_parallel_degree = " + std::to_string(dims.ep) +
                        " but the model has no MoE layers (use a *_moe flavor)");
    }
    return out;
  }
  if (num_experts % dims.ep != 0) {
    throw ConfigError("config error: parallelism.expert_parallel_degree = " + std::to_string(dims.ep) +
                      " does not divide the model's " + std::to_string(num_experts) + " experts");
  }
  out.dim = dims.dp_shard > num_experts ? 1 : 0;
  if (dims.ep > 1) {
    std::vector<int64_t> shape{dims.dp_shard / dims.ep, dims.ep};
    std::vector<std::string> names{"efsdp", "ep"};
    if (dims.dp_replicate > 1) {
      shape.insert(shape.begin(), dims.dp_replicate);
      names.insert(names.begin(), "dp_replicate");
    }
    const fsdp::DeviceMesh sparse = fsdp::init_device_mesh(device, shape, names);
    for (auto& block : model->blocks()) {
      if (auto* moe = moe_of(*block)) fsdp::apply_expert_parallel(moe->experts.ptr(), sparse["ep"]);
    }
    out.mesh = dims.dp_replicate > 1 ? sparse.slice({"dp_replicate", "efsdp"}) : sparse["efsdp"];
    out.description = "EP " + std::to_string(dims.ep) + " (experts' FSDP over " + out.mesh.to_string() + ", Shard(" +
                      std::to_string(out.dim) + ")) + ";
  } else if (out.dim == 1) {
    out.description = "experts Shard(1) + ";
  }
  return out;
}

// Replicas without sharding or tensor parallelism: TorchTitan's DDP path.
bool plain_data_parallel(const ParallelDims& dims) {
  return dims.tp == 1 && dims.dp_shard == 1 && dims.dp_replicate > 1;
}

// Every block, then the root (bottom-up): one gradient all-reduce per block, issued as soon as its backward is
// done (DDP's buckets, overlapping the rest of backward), rather than one flat all-reduce after backward.
void apply_replicate(fsdp::nn::llama::Transformer& model, const fsdp::DeviceMesh& mesh, ParallelPlan& plan) {
  fsdp::ReplicateOptions opts;
  opts.mesh = mesh;
  for (auto& block : model->blocks()) plan.fsdp_modules.push_back(fsdp::replicate(block, opts));
  plan.fsdp_modules.push_back(fsdp::replicate(model, opts));
}

}  // namespace

fsdp::nn::llama::LlamaArgs model_args(const JobConfig& config) {
  const auto& m = config.model;
  fsdp::nn::llama::LlamaArgs args;
  try {
    args = fsdp::nn::llama::model_flavor(to_string(m.name), m.flavor);
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("config error: model.flavor: ") + e.what_without_backtrace());
  }
  const bool overrides = m.moe_score_func != MoeScoreFunc::FlavorDefault || m.moe_shared_experts >= 0 ||
                         m.moe_route_norm != MoeRouteNorm::FlavorDefault ||
                         m.moe_route_scale != 0 || m.moe_load_balance_coeff >= 0 || m.moe_sequence_aux_loss_coeff > 0 ||
                         m.moe_num_expert_groups > 0;
  if (!overrides) return args;
  if (!args.moe) {
    throw ConfigError("config error: model.moe_* keys set, but " + std::string(to_string(m.name)) + " " + m.flavor +
                      " has no MoE layers (use a *_moe flavor)");
  }
  auto& o = *args.moe;
  if (m.moe_score_func != MoeScoreFunc::FlavorDefault) o.score_func = to_string(m.moe_score_func);  // libfsdp's names
  if (m.moe_shared_experts >= 0) o.num_shared_experts = m.moe_shared_experts;
  if (m.moe_route_norm != MoeRouteNorm::FlavorDefault) o.route_norm = m.moe_route_norm == MoeRouteNorm::On;
  if (m.moe_route_scale != 0) o.route_scale = m.moe_route_scale;
  if (m.moe_load_balance_coeff == 0) o.load_balance_coeff.reset();
  else if (m.moe_load_balance_coeff > 0) o.load_balance_coeff = m.moe_load_balance_coeff;
  if (m.moe_sequence_aux_loss_coeff > 0) o.sequence_aux_loss_coeff = m.moe_sequence_aux_loss_coeff;
  if (m.moe_num_expert_groups > 0) {
    o.num_expert_groups = m.moe_num_expert_groups;
    o.num_limited_groups = m.moe_num_limited_groups;
  }
  return args;
}

c10::Device mesh_device(const JobConfig& config) {
  const c10::Device device(config.training.device);  // the form was checked by validate()
  if (device.is_cuda() && !at::hasCUDA()) {
    throw ConfigError("training.device = \"" + config.training.device +
                      "\": CUDA is not available in this process (a CPU build of libtorch, or no GPU visible); "
                      "use \"cpu\"");
  }
  return device;
}

bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group) {
  // Plain data parallelism is fully_shard too: fsdp::replicate over a (dp_replicate, 1) mesh.
  return has_group;
}

bool plan_needs_full_init(const ParallelDims& dims, bool has_group) {
  // Replicas are built whole, then replicate broadcasts replica 0's weights (DDP's guarantee); TP plans need
  // the whole model before they split it.
  return !has_group || plain_data_parallel(dims) || dims.tp > 1 || dims.ep > 1;
}

namespace {

fsdp::FullyShardOptions fsdp_base_options(const JobConfig& config, const fsdp::DeviceMesh& dp_mesh) {
  fsdp::FullyShardOptions base;
  base.mesh = dp_mesh;
  if (config.training.mixed_precision_param != MixedPrecision::Float32 ||
      config.training.mixed_precision_reduce != MixedPrecision::Float32) {
    base.mp_policy.param_dtype = dtype_of(config.training.mixed_precision_param);
    base.mp_policy.reduce_dtype = dtype_of(config.training.mixed_precision_reduce);
  }
  base.offload_policy.cpu_offload = config.training.enable_cpu_offload;
  return base;
}

// TorchTitan's Llama TP plan without the entries for modules this stage does not hold.
fsdp::ParallelizePlan stage_tp_plan(const fsdp::nn::llama::LlamaArgs& args, int64_t tp, bool loss_parallel,
                                    const fsdp::nn::llama::LlamaStageImpl& stage) {
  fsdp::ParallelizePlan all = fsdp::nn::llama::tensor_parallel_plan(args, tp, {true, loss_parallel});
  fsdp::ParallelizePlan kept;
  for (auto& entry : all) {
    const std::string& pattern = entry.first;
    if (pattern == "tok_embeddings" && !stage.first()) continue;
    if ((pattern == "norm" || pattern == "output") && !stage.last()) continue;
    if (pattern.rfind("layers.", 0) == 0 && stage.begin() == stage.end()) continue;
    kept.push_back(std::move(entry));
  }
  return kept;
}

ParallelPlan parallelize_llama_pipeline(fsdp::nn::llama::Transformer& model, const JobConfig& config,
                                        const ParallelDims& dims, const fsdp::ProcessGroupPtr& group) {
  ParallelPlan plan;
  plan.dp_group = group;
  const std::string device = mesh_device(config).is_cuda() ? "cuda" : "cpu";
  plan.activation_checkpointing = apply_activation_checkpointing(model, config);
  TORCH_CHECK(group, "pipeline parallelism needs a process group (run under fsdprun)");
  // Mesh [pp, dp_replicate, dp_shard, tp]: pp outermost (TorchTitan's order), TP innermost.
  std::vector<int64_t> shape{dims.pp};
  std::vector<std::string> names{"pp"};
  if (dims.dp_replicate > 1) {
    shape.push_back(dims.dp_replicate);
    names.push_back("dp_replicate");
  }
  shape.push_back(dims.dp_shard);
  names.push_back("dp_shard");
  if (dims.tp > 1) {
    shape.push_back(dims.tp);
    names.push_back("tp");
  }
  plan.mesh = fsdp::init_device_mesh(device, shape, names);
  plan.pp_group = plan.mesh.group("pp");
  const fsdp::DeviceMesh dp_mesh =
      dims.dp_replicate > 1 ? plan.mesh.slice({"dp_replicate", "dp_shard"}) : plan.mesh["dp_shard"];
  if (dims.tp > 1) {
    plan.tp_mesh = plan.mesh["tp"];
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
  }

  // Stages: TorchTitan's split, placed by the schedule (loop or V).
  const auto& p = config.parallelism;
  const auto kind = fsdp::pipeline::parse_schedule_name(to_string(p.pipeline_parallel_schedule));
  const int64_t n_layers = model->args().n_layers;
  int64_t num_stages = dims.pp * fsdp::pipeline::default_stages_per_rank(kind);
  const bool explicit_fqns = !p.module_fqns_per_model_part.empty();
  if (explicit_fqns) {
    num_stages = static_cast<int64_t>(p.module_fqns_per_model_part.size());
    if (num_stages % dims.pp != 0) {
      throw ConfigError("config error: parallelism.module_fqns_per_model_part lists " + std::to_string(num_stages) +
                        " stages, not a multiple of pipeline_parallel_degree = " + std::to_string(dims.pp));
    }
  } else if (p.pipeline_parallel_layers_per_stage > 0) {
    num_stages = fsdp::nn::llama::stages_for_layers_per_stage(n_layers, p.pipeline_parallel_layers_per_stage,
                                                              p.pipeline_parallel_first_stage_less_layers,
                                                              p.pipeline_parallel_last_stage_less_layers);
    if (num_stages % dims.pp != 0) {
      throw ConfigError("config error: parallelism.pipeline_parallel_layers_per_stage = " +
                        std::to_string(p.pipeline_parallel_layers_per_stage) + " gives " + std::to_string(num_stages) +
                        " stages for " + std::to_string(n_layers) + " layers, not a multiple of "
                        "pipeline_parallel_degree = " + std::to_string(dims.pp));
    }
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  fsdp::pipeline::PipelineSchedule schedule;
  try {
    ranges = explicit_fqns ? fsdp::nn::llama::layers_from_fqns(model->args(), p.module_fqns_per_model_part)
                           : fsdp::nn::llama::split_layers(n_layers, num_stages,
                                                           p.pipeline_parallel_first_stage_less_layers,
                                                           p.pipeline_parallel_last_stage_less_layers);
    schedule = fsdp::pipeline::build_schedule({kind, static_cast<int>(dims.pp), static_cast<int>(num_stages / dims.pp),
                                               static_cast<int>(dims.pp_microbatches)});
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("config error: parallelism: ") + e.what_without_backtrace());
  }
  plan.num_stages = static_cast<int>(num_stages);
  plan.stage_indices = schedule.stages_of_rank(plan.pp_group->rank());
  const fsdp::FullyShardOptions base = fsdp_base_options(config, dp_mesh);
  const ReshardAfterForward policy = config.parallelism.fsdp_reshard_after_forward;
  std::string layers;
  for (int s : plan.stage_indices) {
    const auto [begin, end] = ranges[static_cast<size_t>(s)];
    fsdp::nn::llama::LlamaStage stage(*model, begin, end, s == 0, s == num_stages - 1);
    if (dims.tp > 1) {
      fsdp::parallelize_module(stage, plan.tp_mesh, stage_tp_plan(model->args(), dims.tp, plan.loss_parallel, *stage));
      stage->sequence_shards = dims.tp;  // the plan is sequence parallel: hidden states travel split on the sequence
    }
    fsdp::FullyShardOptions opts = base;
    // Under PP TorchTitan keeps parameters across microbatches (default -> false); "always" reshards anyway.
    opts.reshard_after_forward = policy == ReshardAfterForward::Always;
    for (auto& block : stage->blocks()) plan.fsdp_modules.push_back(fsdp::fully_shard(block, opts));
    plan.fsdp_modules.push_back(fsdp::fully_shard(stage, opts));
    layers += (layers.empty() ? "" : ", ") + std::string("stage ") + std::to_string(s) + " = layers " +
              std::to_string(begin) + ".." + std::to_string(end - 1) + (s == 0 ? " + tok_embeddings" : "") +
              (s == num_stages - 1 ? " + norm, output" : "");
    plan.stages.push_back(stage);
  }
  plan.holds_first_stage = plan.stage_indices.front() == 0;
  plan.holds_last_stage = plan.stage_indices.back() == num_stages - 1;
  for (auto& m : plan.fsdp_modules) m.set_gradient_divide_factor(1.0);
  plan.fsdp = true;
  plan.description = "PP " + std::to_string(dims.pp) + " (" + fsdp::pipeline::schedule_name(kind) + ", " +
                     std::to_string(num_stages) + " stages, " + std::to_string(dims.pp_microbatches) +
                     " microbatches; this rank: " + layers + ") + " + (dims.tp > 1 ? "TP " + std::to_string(dims.tp) +
                     " (sequence parallel) + " : std::string()) + (dims.dp_replicate > 1 ? "HSDP" : "FSDP") +
                     " mesh " + plan.mesh.to_string() + ", reshard_after_forward " +
                     (policy == ReshardAfterForward::Always ? "always" : "false (PP)");
  return plan;
}

}  // namespace

ParallelPlan parallelize_llama(fsdp::nn::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group) {
  bool has_moe = false;
  for (auto& block : model->blocks()) has_moe = has_moe || moe_of(*block) != nullptr;
  if (has_moe && (dims.pp > 1 || dims.tp > 1)) {
    throw ConfigError("config error: MoE models (" + std::string(to_string(config.model.name)) + " " + config.model.flavor + ") with " +
                      (dims.pp > 1 ? "pipeline" : "tensor") + " parallelism are not supported yet; use FSDP, HSDP "
                      "and parallelism.expert_parallel_degree");
  }
  if (has_moe && group && group->size() > 1 && (config.checkpoint.initial_load_in_hf || config.checkpoint.last_save_in_hf)) {
    throw ConfigError("config error: checkpoint.initial_load_in_hf / last_save_in_hf with an MoE model on several "
                      "ranks is not supported yet (the Qwen3-MoE adapter needs the whole model); convert on 1 rank");
  }
  if (has_moe && config.activation_checkpoint.mode == AcMode::Selective &&
      config.activation_checkpoint.selective_ac_option.kind == SelectiveAcOption::Kind::Op) {
    // Op-level SAC runs the forward twice with gradients on: the experts' token counts (load balancing) would
    // double. Full and layer-selective AC count once (their first pass runs without gradients).
    throw ConfigError("config error: activation_checkpoint.selective_ac_option = \"op\" with an MoE model is not "
                      "supported yet; use mode = \"full\" or a layer-selective option");
  }
  if (dims.pp > 1) return parallelize_llama_pipeline(model, config, dims, group);
  ParallelPlan plan;
  plan.dp_group = group;
  const std::string device = mesh_device(config).is_cuda() ? "cuda" : "cpu";  // init_device_mesh takes the type
  plan.activation_checkpointing = apply_activation_checkpointing(model, config);
  if (!group) {
    // fully_shard needs a process group (even a 1-rank one, as under fsdprun); a bare process trains unsharded.
    plan.description = "single process (no process group: run under fsdprun to apply fully_shard)";
    return plan;
  }
  if (plain_data_parallel(dims)) {
    // TorchTitan's DDP path, in FSDP2's style (fsdp::replicate). Full precision, as TorchTitan's DDP: the
    // mixed_precision_* keys apply to FSDP.
    plan.mesh = fsdp::init_device_mesh(device, {dims.dp_replicate, 1}, {"dp_replicate", "dp_shard"});
    apply_replicate(model, plan.mesh, plan);
    for (auto& m : plan.fsdp_modules) m.set_gradient_divide_factor(1.0);
    plan.fsdp = true;
    plan.description = "data parallel (replicate " + std::to_string(dims.dp_replicate) +
                       ", fsdp::replicate: gradient all-reduce per block)";
    return plan;
  }
  fsdp::DeviceMesh dp_mesh;
  std::string tp_description;
  if (dims.tp > 1) {
    // TorchTitan's order: dp_replicate, dp_shard, tp (TP innermost: contiguous ranks).
    std::vector<int64_t> shape{dims.dp_shard, dims.tp};
    std::vector<std::string> names{"dp_shard", "tp"};
    if (dims.dp_replicate > 1) {
      shape.insert(shape.begin(), dims.dp_replicate);
      names.insert(names.begin(), "dp_replicate");
    }
    plan.mesh = fsdp::init_device_mesh(device, shape, names);
    plan.tp_mesh = plan.mesh["tp"];
    dp_mesh = dims.dp_replicate > 1 ? plan.mesh.slice({"dp_replicate", "dp_shard"}) : plan.mesh["dp_shard"];
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
    fsdp::parallelize_module(model, plan.tp_mesh,
                             fsdp::nn::llama::tensor_parallel_plan(model->args(), dims.tp, {true, plan.loss_parallel}));
    tp_description = "TP " + std::to_string(dims.tp) + " (sequence parallel, " +
                     (plan.loss_parallel ? "loss parallel" : "logits gathered") + ") + ";
  } else if (dims.dp_replicate > 1) {
    plan.mesh = fsdp::init_device_mesh(device, {dims.dp_replicate, dims.dp_shard}, {"dp_replicate", "dp_shard"});
    dp_mesh = plan.mesh;
  } else {
    plan.mesh = fsdp::init_device_mesh(device, {dims.dp_shard}, {"dp_shard"});
    dp_mesh = plan.mesh;
  }
  const ExpertSharding experts = apply_expert_parallel_to_blocks(model, dims, device);
  const fsdp::FullyShardOptions base = fsdp_base_options(config, dp_mesh);
  const ReshardAfterForward policy = config.parallelism.fsdp_reshard_after_forward;
  auto& blocks = model->blocks();
  for (size_t i = 0; i < blocks.size(); ++i) {
    fsdp::FullyShardOptions opts = base;
    if (auto* moe = moe_of(*blocks[i]); moe && (experts.mesh.valid() || experts.dim != 0)) {
      // One fully_shard per block with per-parameter meshes (TorchTitan HEAD): the routed experts go to their
      // own parameter group, the rest of the block to the dense one.
      std::unordered_set<const c10::TensorImpl*> expert_params;
      for (const auto& p : moe->experts->parameters()) expert_params.insert(p.unsafeGetTensorImpl());
      opts.shard_placement_fn = [expert_params, experts](const at::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
        if (!expert_params.count(p.unsafeGetTensorImpl())) return std::nullopt;
        return experts.mesh.valid() ? fsdp::ShardPlacement{experts.dim, experts.mesh} : fsdp::ShardPlacement{experts.dim};
      };
    }
    if (policy == ReshardAfterForward::Always) opts.reshard_after_forward = true;
    else if (policy == ReshardAfterForward::Never) opts.reshard_after_forward = false;
    else opts.reshard_after_forward = i + 1 < blocks.size();  // backward starts with the last block: keep it
    plan.fsdp_modules.push_back(fsdp::fully_shard(blocks[i], opts));
  }
  fsdp::FullyShardOptions root = base;
  if (policy == ReshardAfterForward::Always) root.reshard_after_forward = true;  // default/never: the root stays unsharded (FSDP2's root rule)
  plan.fsdp_modules.push_back(fsdp::fully_shard(model, root));
  for (auto& m : plan.fsdp_modules) m.set_gradient_divide_factor(1.0);
  plan.fsdp = true;
  plan.description = tp_description + experts.description + std::string(dims.dp_replicate > 1 ? "HSDP" : "FSDP") +
                     " mesh " + plan.mesh.to_string() +
                     ", reshard_after_forward " + to_string(policy) + ", param " +
                     to_string(config.training.mixed_precision_param) + ", reduce " +
                     to_string(config.training.mixed_precision_reduce);
  return plan;
}

}  // namespace fsdp_train
