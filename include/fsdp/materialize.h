#pragma once
// Meta-device initialization for fully_shard models (PyTorch: build on `meta`, fully_shard, to_empty, init).
//
//   LlamaArgs args = ...; args.device = c10::kMeta;        // no memory for the full model anywhere
//   Transformer model(args);
//   ... fully_shard each block, then the root ...          // shards of meta tensors: still no memory
//   fsdp::materialize_module(*model);                       // each rank allocates only its shards
//   model->init_weights(seed, fsdp::full_params_init_scope(*model));   // identical to an unsharded init
//
// An initializer written for full parameters runs unchanged: init_with_full_params shows one FSDP unit's full
// parameters (an all-gather), runs the initializer, and keeps this rank's rows. Peak memory is one unit, and
// with a deterministic generator shared in the same order the result equals initializing the unsharded model.

#include <fsdp/fully_shard.h>

#include <torch/nn/module.h>

#include <functional>

namespace fsdp {

// Allocates real, zeroed storage on each mesh's device for every meta tensor under `root`: only the local
// shard for FSDP-managed parameters; the full tensor for other parameters and buffers (on `device`).
void materialize_module(torch::nn::Module& root, c10::Device device = c10::kCPU);

// Runs `init` (under NoGradGuard) while `unit`'s parameters show their full data, then stores this rank's rows
// back into its shards and reshards. Collective over the unit's shard group.
void init_with_full_params(const FSDPModule& unit, const std::function<void()>& init);

// A scope for model initializers that take one (`void(torch::nn::Module& part, const std::function<void()>& fn)`):
// runs fn with the full parameters of the FSDP unit that owns `part` (found by walking up from `part` within
// `root`), or directly when `part` is not sharded.
std::function<void(torch::nn::Module&, const std::function<void()>&)> full_params_init_scope(torch::nn::Module& root);

}  // namespace fsdp
