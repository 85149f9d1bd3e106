// fsdp::replicate (include/fsdp/replicate.h): DDP on FSDP2's machinery. fully_shard over a (replicate = N,
// shard = 1) mesh already is data parallelism — the shard group has one rank, so the "all-gather" and the
// "reduce-scatter" are local, and HSDP's replicate all-reduce averages the gradients over the replicas — so this
// file only picks that mesh and does what DDP adds at construction: one copy of the initial state for all.

#include "fully_shard/mesh_cache.h"

#include <fsdp/process_group.h>
#include <fsdp/replicate.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <functional>
#include <map>
#include <string>
#include <unordered_set>

namespace fsdp {
namespace {

// The (replicate, shard = 1) mesh for the replicas `given` names (see ReplicateOptions::mesh).
DeviceMesh replicate_mesh(const DeviceMesh& given) {
  if (given.valid() && given.ndim() == 2) {
    TORCH_CHECK(given.size(1) == 1, "fsdp::replicate: the mesh ", given.to_string(), " shards parameters over ",
                given.size(1), " ranks on its dim '", given.dim_names()[1],
                "'; replicate needs a shard dim of size 1 (for sharded replicas, HSDP, use fully_shard)");
    return given;
  }
  TORCH_CHECK(!given.valid() || given.ndim() == 1, "fsdp::replicate: expects a 1-D replicate mesh or a 2-D "
              "(replicate, shard) mesh with shard size 1, got ", given.to_string());
  const ProcessGroupPtr w = world();
  std::vector<int> ranks;
  c10::DeviceType type = w->device().type();
  if (given.valid()) {
    // A mesh over the whole world can be rebuilt as (N, 1) by every rank alike; one over part of it cannot
    // (creating groups is collective over the world, and the other ranks do not know this mesh).
    TORCH_CHECK(given.size() == w->size(), "fsdp::replicate: the 1-D mesh ", given.to_string(), " covers ",
                given.size(), " of the world's ", w->size(), " ranks; for replicas over part of the world pass a 2-D "
                "(replicate, shard) mesh with shard size 1 made over the whole world (e.g. init_device_mesh(..., "
                "{replicas, 1, ...}) and a slice of it)");
    ranks = given.ranks();
    type = given.device_type();
  } else {
    for (int r = 0; r < w->size(); ++r) ranks.push_back(r);
  }
  std::string key = c10::str("replicate/", c10::DeviceTypeName(type, /*lower_case=*/true));
  for (int r : ranks) key += c10::str("/", r);
  const auto n = static_cast<int64_t>(ranks.size());
  // Cached: bottom-up calls (one per block) share one mesh and its groups instead of creating them per call.
  return detail::cached_mesh(key, [&] { return DeviceMesh(type, {n, 1}, {"replicate", "shard"}, ranks); });
}

// DDP's construction-time sync: the parameters and buffers this call takes over — the module's own and those of
// submodules not already under fully_shard/replicate (their own call broadcast them) — are broadcast from
// replica 0, one flat message per dtype. Every replica walks the same tree, so the messages match.
void broadcast_from_replica0(torch::nn::Module& module, ProcessGroup& group, const std::vector<at::Tensor>& ignored) {
  if (group.size() == 1) return;
  std::unordered_set<const c10::TensorImpl*> skip;
  for (const auto& t : ignored) skip.insert(t.unsafeGetTensorImpl());
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  auto take = [&](const at::Tensor& t) {
    if (!t.defined() || t.is_meta() || !skip.insert(t.unsafeGetTensorImpl()).second) return;  // tied: once
    by_dtype[t.scalar_type()].push_back(t);
  };
  std::function<void(torch::nn::Module&)> walk = [&](torch::nn::Module& m) {
    for (const auto& p : m.named_parameters(/*recurse=*/false)) take(p.value());
    for (const auto& b : m.named_buffers(/*recurse=*/false)) take(b.value());
    for (const auto& child : m.children()) {
      if (!fsdp_module(*child)) walk(*child);
    }
  };
  walk(module);
  torch::NoGradGuard no_grad;
  for (auto& [dtype, tensors] : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : tensors) flat_parts.push_back(t.detach().reshape({-1}).to(group.device()));
    at::Tensor flat = at::cat(flat_parts);
    group.broadcast(flat, /*root=*/0).wait();
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

FSDPModule replicate(const std::shared_ptr<torch::nn::Module>& module, const ReplicateOptions& options) {
  TORCH_CHECK(module != nullptr, "fsdp::replicate: null module");
  TORCH_CHECK(!fsdp_module(*module), "fsdp::replicate: module ", module->name(), " is already under fully_shard or "
              "replicate");
  FullyShardOptions shard_options;
  shard_options.mesh = replicate_mesh(options.mesh);
  shard_options.mp_policy = options.mp_policy;
  shard_options.ignored_params = options.ignored_params;
  // One shard per rank: after forward there is nothing to free (the unsharded parameters are the whole ones).
  shard_options.reshard_after_forward = false;
  const ProcessGroupPtr replicas = shard_options.mesh.group(0);
  broadcast_from_replica0(*module, *replicas, options.ignored_params);
  return fully_shard(module, shard_options);
}

}  // namespace fsdp
