#pragma once
// Model and optimizer state dicts for checkpoints, keyed as TorchTitan flattens them:
//   model:      <fqn>                                   (no prefix)
//   optimizer:  optimizer.state.<fqn>.{exp_avg, exp_avg_sq, max_exp_avg_sq, step, momentum_buffer}
//               optimizer.param_groups.<fqn>.{lr, betas, eps, weight_decay, amsgrad, momentum, dampening, nesterov}
//               and torch.optim's group keys libtorch lacks ({maximize, foreach, capturable, differentiable, fused,
//               decoupled_weight_decay}: what libtorch does; written so that PyTorch's dcp.load finds every key)
// For fully_shard models each state tensor is a ShardedTensor with its parameter's mesh, placements and global
// shape (the optimizer runs on the shards), so a checkpoint loads into a freshly built optimizer on another mesh
// or world size. Supported: torch::optim::Adam, AdamW, SGD. `step` is a replicated 0-dim int64 tensor.

#include <fsdp/checkpoint/checkpoint.h>

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint {

// The model's parameters (deduplicated) and buffers. Entries alias the model (shards of fully_shard models,
// whole tensors otherwise), so load() writes into the model directly.
StateDict model_state_dict(torch::nn::Module& model);
// Copies `state` into the model where its entries do not alias it (a state dict of another model object).
void load_model_state_dict(torch::nn::Module& model, const StateDict& state);

// The optimizer's state; missing per-parameter state is created first (zeros, step 0 — what the first step()
// would create), so a fresh optimizer yields the entries a checkpoint is loaded into. Tensor entries alias the
// optimizer's state tensors; steps and hyperparameters are copies: call load_optimizer_state_dict after load().
StateDict optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optim,
                               const std::string& prefix = "optimizer");
// Applies steps, hyperparameters (per parameter group) and any tensor that does not alias the optimizer's state.
// Keys absent from `state` (non-strict or excluded loads) leave the optimizer's value as it is.
void load_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optim, const StateDict& state,
                               const std::string& prefix = "optimizer");

// A model in parts that share one FQN space (pipeline stages: each part registers its modules under the whole
// model's names, TorchTitan's ModelWrapper) and one optimizer over all of them. The state dict is the union of
// the parts' (their keys must not overlap); what the functions above do, over every part.
using ModelParts = std::vector<torch::nn::Module*>;
StateDict model_state_dict(const ModelParts& parts);
void load_model_state_dict(const ModelParts& parts, const StateDict& state);
StateDict optimizer_state_dict(const ModelParts& parts, torch::optim::Optimizer& optim,
                               const std::string& prefix = "optimizer");
void load_optimizer_state_dict(const ModelParts& parts, torch::optim::Optimizer& optim, const StateDict& state,
                               const std::string& prefix = "optimizer");

}  // namespace fsdp::checkpoint
