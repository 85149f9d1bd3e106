// See parallelize.h.
#include "parallelize.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/models/llama_tp_plan.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace fsdp_train {
namespace {

c10::ScalarType dtype_of(const std::string& name) { return name == "bfloat16" ? c10::kBFloat16 : c10::kFloat; }

void broadcast_parameters(torch::nn::Module& model, const fsdp::ProcessGroupPtr& group) {
  // Every rank initialised from the same seed already; the broadcast makes identity a guarantee, not a hope.
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> params;
  for (auto& p : model.parameters()) params.push_back(p.detach().reshape(-1));
  auto flat = at::cat(params);
  group->broadcast(flat, 0).wait();
  int64_t off = 0;
  for (auto& p : model.parameters()) {
    p.detach().view(-1).copy_(flat.narrow(0, off, p.numel()));
    off += p.numel();
  }
}

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

}  // namespace

bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group) {
  return has_group && (dims.tp > 1 || !(dims.dp_shard == 1 && dims.dp_replicate > 1));
}

bool plan_needs_full_init(const ParallelDims& dims, bool has_group) {
  return !plan_uses_fully_shard(dims, has_group) || dims.tp > 1;
}

ParallelPlan parallelize_llama(fsdp::nn::llama::Transformer& model, const JobConfig& config, const ParallelDims& dims,
                               const fsdp::ProcessGroupPtr& group) {
  ParallelPlan plan;
  plan.dp_group = group;
  plan.activation_checkpointing = apply_activation_checkpointing(model, config);
  if (!group) {
    // fully_shard needs a process group (even a 1-rank one, as under fsdprun); a bare process trains unsharded.
    plan.description = "single process (no process group: run under fsdprun to apply fully_shard)";
    return plan;
  }
  if (!plan_uses_fully_shard(dims, true)) {
    plan.ddp = true;
    broadcast_parameters(*model, group);
    plan.description = "data parallel (replicate " + std::to_string(dims.dp_replicate) + ", gradient all-reduce)";
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
    plan.mesh = fsdp::init_device_mesh("cpu", shape, names);
    plan.tp_mesh = plan.mesh["tp"];
    dp_mesh = dims.dp_replicate > 1 ? plan.mesh.slice({"dp_replicate", "dp_shard"}) : plan.mesh["dp_shard"];
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
    fsdp::parallelize_module(model, plan.tp_mesh,
                             fsdp::nn::llama::tensor_parallel_plan(model->args(), dims.tp, {true, plan.loss_parallel}));
    tp_description = "TP " + std::to_string(dims.tp) + " (sequence parallel, " +
                     (plan.loss_parallel ? "loss parallel" : "logits gathered") + ") + ";
  } else if (dims.dp_replicate > 1) {
    plan.mesh = fsdp::init_device_mesh("cpu", {dims.dp_replicate, dims.dp_shard}, {"dp_replicate", "dp_shard"});
    dp_mesh = plan.mesh;
  } else {
    plan.mesh = fsdp::init_device_mesh("cpu", {dims.dp_shard}, {"dp_shard"});
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

void sync_replicated_gradients(torch::nn::Module& model, const ParallelPlan& plan) {
  if (!plan.ddp) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> params;
  for (auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    params.push_back(p);
    grads.push_back(p.grad().reshape(-1));
  }
  auto flat = at::cat(grads);
  plan.dp_group->all_reduce(flat, fsdp::ReduceOp::Sum).wait();
  int64_t off = 0;
  for (auto& p : params) {
    p.mutable_grad().view(-1).copy_(flat.narrow(0, off, p.numel()));
    off += p.numel();
  }
}

}  // namespace fsdp_train
