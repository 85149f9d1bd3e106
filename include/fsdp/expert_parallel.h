#pragma once
// Expert parallelism: the routed experts of a mixture-of-experts layer split over an `ep` mesh dim, each token
// sent to the rank holding its expert and its result sent back (TorchTitan's ExpertParallel style and
// AllToAllTokenDispatcher; facts in shared/reference/moe-expert-parallel.md section 4).
//
//   fsdp::parallelize_module(block->moe->experts, mesh["ep"], {{"", fsdp::ExpertParallel{}}});
//   // or fsdp::apply_expert_parallel(experts, mesh["ep"]); then fully_shard the block, the experts over the
//   // data-parallel ranks left after ep (ShardPlacement{dim, efsdp_mesh}).
//
// The module it applies to holds the experts' weights stacked, experts on dim 0 ([E, ...], every parameter of
// the module itself), and its forward takes (rows [R, D] grouped by expert in ascending order, counts [E] int64:
// rows per expert) and returns one row per input row, in the same order (fsdp::models::moe::GroupedExperts does).
// ExpertParallel:
//   - keeps experts [r*E/ep, (r+1)*E/ep) on ep rank r (each parameter's dim 0 split, recorded like a
//     tensor-parallel Shard(0) so fully_shard, state dicts and checkpoints see the global [E, ...] tensor);
//   - around each forward (a forward wrapper, so the module's own code is unchanged): exchanges the token counts
//     (one all-to-all of E integers), sends each expert's rows to its rank (all-to-all of uneven sizes), regroups
//     the received rows by local expert, runs the experts on them, and sends the results back (the reverse
//     all-to-all). Backward runs the two row exchanges in reverse. Experts or ranks that receive no tokens still
//     run (empty groups) so every rank issues the same collectives.
// The module must be called through fsdp::nn::call (the hook rule) and owned by a std::shared_ptr. The count
// exchange needs the counts on the host: one device-to-host copy per forward (as TorchTitan's).

#include <fsdp/device_mesh.h>

#include <torch/nn/module.h>

#include <memory>

namespace fsdp {

struct ExpertParallel {};

// Applies ExpertParallel to `experts` over the 1-D `ep_mesh`. Every ep rank must hold the same full weights
// before (same seed, or a broadcast) and keeps its experts; collective-free. The expert count must divide by
// the ep degree. Apply it before fully_shard, as tensor parallelism.
void apply_expert_parallel(const std::shared_ptr<torch::nn::Module>& experts, const DeviceMesh& ep_mesh);

// True when `module` is expert-parallel (apply_expert_parallel ran on it).
bool is_expert_parallel(const torch::nn::Module& module);

}  // namespace fsdp
