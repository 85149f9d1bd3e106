// See parallelize.h.
#include "parallelize.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/replicate.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

namespace fsdp_train {
namespace {

c10::ScalarType dtype_of(const std::string& name) { return name == "bfloat16" ? c10::kBFloat16 : c10::kFloat; }

// [activation_checkpoint] on every transformer block, before fully_shard (TorchTitan's order: AC wrap, then FSDP).
std::string apply_activation_checkpointing(fsdp::nn::llama::Transformer& model, const JobConfig& config) {
  const auto& ac = config.activation_checkpoint;
  if (ac.mode == "none") return "no activation checkpointing";
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (auto& b : model->blocks()) blocks.push_back(b.ptr());
  if (ac.mode == "full") {
    fsdp::checkpoint_every_kth(blocks, 1);
    return "full activation checkpointing (every block)";
  }
  if (ac.selective_ac_option == "op") {
    fsdp::checkpoint_every_kth(blocks, 1, {fsdp::CheckpointPolicy::SelectiveOp});
    return "op-level selective activation checkpointing (every 2nd matmul kept)";
  }
  const int64_t k = std::stoll(ac.selective_ac_option);  // validated in config.cpp
  const size_t n = fsdp::checkpoint_every_kth(blocks, k);
  return "layer-selective activation checkpointing (every " + std::to_string(k <= 1 ? 1 : k) + " blocks: " +
         std::to_string(n) + " of " + std::to_string(blocks.size()) + ")";
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
  return !has_group || plain_data_parallel(dims) || dims.tp > 1;
}

ParallelPlan parallelize_llama(fsdp::nn::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group) {
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
  fsdp::FullyShardOptions base;
  base.mesh = dp_mesh;
  if (config.training.mixed_precision_param != "float32" || config.training.mixed_precision_reduce != "float32") {
    base.mp_policy.param_dtype = dtype_of(config.training.mixed_precision_param);
    base.mp_policy.reduce_dtype = dtype_of(config.training.mixed_precision_reduce);
  }
  base.offload_policy.cpu_offload = config.training.enable_cpu_offload;
  const std::string& policy = config.parallelism.fsdp_reshard_after_forward;
  auto& blocks = model->blocks();
  for (size_t i = 0; i < blocks.size(); ++i) {
    fsdp::FullyShardOptions opts = base;
    if (policy == "always") opts.reshard_after_forward = true;
    else if (policy == "never") opts.reshard_after_forward = false;
    else opts.reshard_after_forward = i + 1 < blocks.size();  // backward starts with the last block: keep it
    plan.fsdp_modules.push_back(fsdp::fully_shard(blocks[i], opts));
  }
  fsdp::FullyShardOptions root = base;
  if (policy == "always") root.reshard_after_forward = true;  // default/never: the root stays unsharded (FSDP2's root rule)
  plan.fsdp_modules.push_back(fsdp::fully_shard(model, root));
  for (auto& m : plan.fsdp_modules) m.set_gradient_divide_factor(1.0);
  plan.fsdp = true;
  plan.description = tp_description + std::string(dims.dp_replicate > 1 ? "HSDP" : "FSDP") + " mesh " + plan.mesh.to_string() +
                     ", reshard_after_forward " + policy + ", param " + config.training.mixed_precision_param +
                     ", reduce " + config.training.mixed_precision_reduce;
  return plan;
}

}  // namespace fsdp_train
