#pragma once
// fsdp::replicate — data parallelism (DDP) in FSDP2's style, as PyTorch's newer replicate(): every rank holds the
// whole model, gradients are averaged over the replicas by an all-reduce in backward. Built on fully_shard over a
// 2-D (replicate = N, shard = 1) mesh, so it has FSDP2's machinery and handle — applied bottom-up like
// fully_shard, one all-reduce per replicated module (a bucket per module, like DDP's buckets), no_sync through
// set_requires_gradient_sync(false), mixed precision, the all-reduce hook — and parameters are never sharded.
//
//   fsdp::ReplicateOptions opts;                                       // default: every rank of the world
//   for (auto& block : *model->layers) fsdp::replicate(block, opts);   // bottom-up
//   fsdp::replicate(model, opts);
//   auto loss = fsdp::nn::call(model, tokens) ...;                     // the hook rule, as for fully_shard
//
// Like DDP at construction, replicate broadcasts the parameters and buffers it takes over from replica 0, so
// replicas start identical (parameters still on the meta device are skipped: initialize them identically).
// Gradients are averaged (DDP's default); set_gradient_divide_factor on the handle changes the divisor.

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <vector>

namespace fsdp {

struct ReplicateOptions {
  // The replicas: invalid (default) = every rank of the world; a 1-D mesh over the whole world (its ranks in its
  // order); or a 2-D (replicate, shard) mesh whose shard dim has size 1 (e.g. TorchTitan's
  // ("dp_replicate", "dp_shard") with dp_shard 1). A shard dim larger than 1 is HSDP: use fully_shard.
  DeviceMesh mesh;
  MixedPrecisionPolicy mp_policy;
  // Not broadcast, gradients not reduced, kept out of later replicate/fully_shard calls on ancestors.
  std::vector<at::Tensor> ignored_params;
};

FSDPModule replicate(const std::shared_ptr<torch::nn::Module>& module, const ReplicateOptions& options = {});
template <class Impl>
FSDPModule replicate(const torch::nn::ModuleHolder<Impl>& module, const ReplicateOptions& options = {}) {
  return replicate(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

}  // namespace fsdp
