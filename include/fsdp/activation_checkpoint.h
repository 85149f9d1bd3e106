#pragma once
// Activation checkpointing for libtorch modules (PyTorch's composable torch.distributed._composable.checkpoint):
// the module's forward keeps only its inputs (and, for SelectiveOp, every second matmul output); backward runs
// the forward again to rebuild what it needs. No wrapper module: parameter FQNs and state dicts are unchanged.
// The module must be invoked through fsdp::nn::call (the hook rule, docs/hooks.md). Semantics and composition
// with fully_shard: docs/activation_checkpoint.md.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fsdp {

enum class CheckpointPolicy {
  Full,         // save the inputs only; recompute the whole forward in backward
  SelectiveOp,  // TorchTitan's op-level SAC: keep every second mm/addmm/bmm output (1st, 3rd, ...), recompute the rest
};

struct CheckpointOptions {
  CheckpointPolicy policy = CheckpointPolicy::Full;
  // Stash the CPU generator (and the device generator of the inputs' device type) at forward and replay them
  // during recomputation, so dropout draws the same masks.
  bool preserve_rng_state = true;
};

// Checkpoint `module`'s forward. Applying it twice is an error. Order with fully_shard does not matter. A module
// whose *descendants* are given to fully_shard may be checkpointed with CheckpointPolicy::Full (their gradients
// then accumulate in the recomputation's backward; docs/activation_checkpoint.md), not with SelectiveOp.
void checkpoint_module(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options = {});
template <class Impl>
void checkpoint_module(const torch::nn::ModuleHolder<Impl>& module, const CheckpointOptions& options = {}) {
  checkpoint_module(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}
bool is_checkpointed(const torch::nn::Module& module);

// Which pass of a checkpointed region the calling thread is running: a module whose forward has side effects
// that must happen once per step (an MoE block counting the tokens each expert received) asks this. Forward:
// the region's first pass (Full: without gradients; SelectiveOp: with gradients, its graph dropped). Recompute:
// the pass its backward runs (with gradients) — the same forward a second time. None: outside any region.
enum class CheckpointPass { None, Forward, Recompute };
CheckpointPass current_checkpoint_pass();

// Layer SAC (TorchTitan's selective_ac_option = "k"): full checkpointing of every k-th module, counted from 1
// (k = 2 checkpoints blocks 1, 3, 5, ...; k = 0 or 1 every block). Returns how many modules were checkpointed.
size_t checkpoint_every_kth(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, int64_t k,
                            const CheckpointOptions& options = {});

// How much checkpointing did in one model (tests, the trainer's log): the sum over `root` and every checkpointed
// module below it. Each checkpointed module keeps its own counters, so two models in a process never mix.
struct CheckpointStats {
  int64_t forwards = 0;       // checkpointed forwards that recorded a region (grad mode on, something needs grad)
  int64_t recomputes = 0;     // regions recomputed in backward
  int64_t mm_saved = 0;       // SelectiveOp: matmul outputs kept at forward
  int64_t mm_reused = 0;      // SelectiveOp: kept outputs handed back during recomputation (not computed)
  int64_t mm_recomputed = 0;  // SelectiveOp: matmuls computed again during recomputation
};
CheckpointStats checkpoint_stats(const torch::nn::Module& root);
void reset_checkpoint_stats(const torch::nn::Module& root);
template <class Impl>
CheckpointStats checkpoint_stats(const torch::nn::ModuleHolder<Impl>& root) {
  return checkpoint_stats(*root);
}
template <class Impl>
void reset_checkpoint_stats(const torch::nn::ModuleHolder<Impl>& root) {
  reset_checkpoint_stats(*root);
}

}  // namespace fsdp
