#pragma once
// FSDP1 -> FSDP2 migration: fsdp::prepare_fully_shard applies fully_shard to a model from FSDP1-style settings
// (ShardingStrategy, MixedPrecision, CPUOffload, a wrap rule, ...), the way Composer's prepare_fsdp_module does.
//
//   fsdp::Fsdp1Config cfg;
//   cfg.sharding_strategy = fsdp::parse_sharding_strategy("HYBRID_SHARD");
//   cfg.hybrid_replicate_degree = 2;                     // 2 replicas x (world / 2)-way sharding
//   auto prepared = fsdp::prepare_fully_shard(model, cfg);
//   torch::optim::AdamW optim(model->parameters(), ...);  // after sharding: the optimizer must see the shards
//
// Every FSDP1 argument is either mapped or rejected with the reason and the FSDP2 replacement; the table is
// docs/migration.md. Wrapped modules must be called through fsdp::nn::call by their parent (the hook rule).

#include <fsdp/activation_checkpoint.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace fsdp {

// FSDP1's ShardingStrategy. _HYBRID_SHARD_ZERO2 is spelled HYBRID_SHARD_ZERO2 (a leading underscore plus a
// capital is reserved in C++); parse_sharding_strategy accepts both spellings.
enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 };

// "FULL_SHARD", "full_shard", "ShardingStrategy.FULL_SHARD", "_HYBRID_SHARD_ZERO2", or FSDP1's enum values
// "1".."5". Anything else is an error listing the valid names.
ShardingStrategy parse_sharding_strategy(std::string_view name);
const char* to_string(ShardingStrategy strategy);  // FSDP1's spelling ("_HYBRID_SHARD_ZERO2")

// FSDP1's BackwardPrefetch (NONE = FSDP1's backward_prefetch=None).
enum class BackwardPrefetch { BACKWARD_PRE, BACKWARD_POST, NONE };

// FSDP1's MixedPrecision with its defaults.
struct Fsdp1MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;  // unset = param_dtype (as in both FSDP1 and FSDP2)
  std::optional<c10::ScalarType> buffer_dtype;  // MixedPrecisionPolicy::buffer_dtype (FSDP1's semantics)
  bool keep_low_precision_grads = false;        // true is rejected: FSDP2 keeps gradients in the parameter dtype
  bool cast_forward_inputs = false;             // every wrapped module casts its floating-point inputs
  bool cast_root_forward_inputs = true;         // the root casts its floating-point inputs
};

// Which modules get their own fully_shard call: (FQN relative to the model, module). The root is always
// sharded last and is never asked.
using WrapPolicy = std::function<bool(const std::string& fqn, const torch::nn::Module& module)>;

// FSDP1's transformer_auto_wrap_policy / ModuleWrapPolicy: wrap every module whose Impl is one of `Impls`.
template <class... Impls>
WrapPolicy module_wrap_policy() {
  return [](const std::string&, const torch::nn::Module& m) {
    return (... || (dynamic_cast<const Impls*>(&m) != nullptr));
  };
}

struct Fsdp1Config {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  std::optional<Fsdp1MixedPrecision> mixed_precision;
  bool cpu_offload = false;  // FSDP1 CPUOffload(offload_params=true) -> OffloadPolicy{cpu_offload=true}

  // The wrap rule (FSDP1's auto_wrap_policy, Composer's fsdp_wrap_fn). Empty = every direct child of the model
  // that holds parameters, looking through ModuleList/ModuleDict (they have no forward of their own), as
  // Composer's prepare_fsdp_module does. Modules sharing a parameter are not wrapped apart: their common
  // ancestor is wrapped instead (see PreparedModule::notes).
  WrapPolicy auto_wrap_policy;

  // Activation checkpointing (fsdp::checkpoint_module) applied before sharding: true = every wrapped module
  // that has no wrapped module below it (the blocks); a predicate = the non-root modules it selects, which must
  // not contain a wrapped module (checkpoint those instead). Composer's activation_checkpointing_fn.
  std::variant<bool, WrapPolicy> activation_checkpointing = false;
  CheckpointOptions activation_checkpointing_options;  // Full or SelectiveOp, RNG preservation

  // Topology: FSDP1's device_mesh / process_group. Invalid = built over the world from the strategy:
  // FULL_SHARD, SHARD_GRAD_OP: 1-D (world); HYBRID_*: 2-D (replicate, shard); NO_SHARD: 2-D (world, 1).
  DeviceMesh device_mesh;
  // HYBRID_*: number of replicas (FSDP1 shards within a node: unset (0) = WORLD_SIZE / LOCAL_WORLD_SIZE).
  int64_t hybrid_replicate_degree = 0;

  // FSDP1's ignored_modules / ignored_states: their parameters are not sharded and their gradients not reduced.
  std::vector<std::shared_ptr<torch::nn::Module>> ignored_modules;
  std::vector<at::Tensor> ignored_states;

  // Arguments FSDP2 removed: unset = not given. Each is mapped or rejected with the reason (docs/migration.md).
  std::optional<BackwardPrefetch> backward_prefetch;  // BACKWARD_PRE: FSDP2's behaviour; others rejected
  std::optional<bool> forward_prefetch;               // accepted: FSDP2 always prefetches the next forward group
  // Called once for each module that directly holds meta-device parameters or buffers, after sharding, with
  // that module's full parameters visible (zero-filled); it initializes them in place (under NoGradGuard).
  std::function<void(torch::nn::Module&)> param_init_fn;
  std::optional<c10::Device> device_id;  // the model is moved there before sharding; the mesh uses its type
  bool sync_module_states = false;       // true: parameters and buffers broadcast from rank 0 before sharding
  std::optional<bool> limit_all_gathers; // accepted, no effect: FSDP2 holds at most the current + next group
  std::optional<bool> use_orig_params;   // true: FSDP2's only mode; false rejected (no FlatParameter)
};

struct PreparedModule {
  std::vector<FSDPModule> units;     // in application order: bottom-up, the root last
  std::vector<std::string> fqns;     // units[i]'s FQN ("" = the root)
  DeviceMesh mesh;                   // the mesh every unit uses
  std::vector<std::string> checkpointed;  // FQNs given to checkpoint_module
  std::vector<std::string> notes;    // decisions worth logging (tied weights moved to a common ancestor, ...)
};

// Checks the config (all errors before any side effect), then: checkpoints (activation_checkpointing), moves
// the model (device_id), broadcasts from rank 0 (sync_module_states), applies fully_shard bottom-up to the wrapped
// modules and last to the root, and runs param_init_fn. Collective: every rank calls it with the same config.
PreparedModule prepare_fully_shard(const std::shared_ptr<torch::nn::Module>& model, const Fsdp1Config& config = {});
template <class Impl>
PreparedModule prepare_fully_shard(const torch::nn::ModuleHolder<Impl>& model, const Fsdp1Config& config = {}) {
  return prepare_fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), config);
}

// The FQNs prepare_fully_shard would wrap (bottom-up, the root "" last), without sharding or communicating.
// `notes` (optional) receives the same notes, including which modules would be checkpointed.
std::vector<std::string> plan_fully_shard(const torch::nn::Module& model, const Fsdp1Config& config = {},
                                          std::vector<std::string>* notes = nullptr);

}  // namespace fsdp
