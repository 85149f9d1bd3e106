#pragma once
// Where parallelize_module records each TP-sharded parameter's global shape and placement: a child module of
// the parameter's owner (libtorch modules have no slot for extra state; a child ties the record's lifetime to
// the module without a global registry, like the forward-hook store). It holds no parameters or buffers.
// Tensor layer (docs/architecture.md): tensor_parallel writes the specs, fully_shard and state dicts read them,
// and neither of those two layers may see the other.

#include <fsdp/tensor_parallel_spec.h>

#include <torch/nn/module.h>

#include <string>
#include <unordered_map>

namespace fsdp::tp {

// Replaces `owner`'s parameter `name` (its full value on every rank) by this rank's piece under `placement`
// over the 1-D `mesh` (same tensor identity, via set_data) and records the spec. Collective-free.
void shard_parameter(torch::nn::Module& owner, const std::string& name, const DeviceMesh& mesh,
                     const Placement& placement);

// The recorded spec of `owner`'s own parameter `name`, or nullptr.
const TensorParallelSpec* find_spec(const torch::nn::Module& owner, const std::string& name);

// Every TP-sharded parameter under `root` (itself included), by tensor identity.
std::unordered_map<const c10::TensorImpl*, TensorParallelSpec> collect_specs(const torch::nn::Module& root);

}  // namespace fsdp::tp
