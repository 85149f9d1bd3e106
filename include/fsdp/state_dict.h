#pragma once
// State dicts of FSDP models (Python's get_model_state_dict / set_model_state_dict for fully_shard models).
//
// Sharded: every parameter as a ShardedTensor over its FSDP mesh — this rank's dim-0 shard, the global shape
// and offsets, placements (Shard(0)) or, for HSDP, (Replicate(), Shard(0)). No communication, no copies.
// Full: gathered, unsharded tensors (collective), one parameter at a time so peak memory grows by one
// parameter, not by the model (PyTorch issue 137151).
//
// Parameters not managed by FSDP (ignored) and buffers are replicated: they appear with Replicate()
// placements in the sharded dict and as-is in the full dict.

#include <fsdp/sharded_tensor.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

namespace fsdp {

using ShardedStateDict = std::map<std::string, ShardedTensor>;
using FullStateDict = std::map<std::string, at::Tensor>;

// Local shards with their global metadata; no communication. Call between steps; a group left unsharded
// after forward (the root by default, or after unshard()) is resharded first. Keys are the root's FQNs
// (parameters, then buffers).
ShardedStateDict sharded_state_dict(torch::nn::Module& root);
// Copies local shards from `state` into the model (in place: optimizers keep working). Every key of the model
// must be present with the same global shape; extra keys are an error naming them.
void load_sharded_state_dict(torch::nn::Module& root, const ShardedStateDict& state);

struct FullStateDictOptions {
  bool cpu_offload = true;  // gathered tensors are moved to the CPU
  bool rank0_only = true;   // other ranks return an empty dict (they still take part in the gathers)
};
// Collective over every rank of the model's meshes.
FullStateDict full_state_dict(torch::nn::Module& root, const FullStateDictOptions& options = {});
// Loads full tensors: each rank copies its own rows. With broadcast_from_rank0, only rank 0's `state` is read
// and every tensor is broadcast from it (collective), so other ranks may pass an empty dict.
void load_full_state_dict(torch::nn::Module& root, const FullStateDict& state, bool broadcast_from_rank0 = false);

}  // namespace fsdp
