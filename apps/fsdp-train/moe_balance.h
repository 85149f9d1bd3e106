#pragma once
// MoE load balancing between steps (TorchTitan's optimizer step pre-hook, components/optimizer/optimizer.py): the
// tokens each expert received in this step's forwards, summed over the data-parallel ranks in one collective for
// all layers, drive DeepSeek-V3's aux-loss-free bias update of every MoE layer; the same counts are the step's
// expert-load metrics.

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

namespace fsdp::models::moe {
class MoEImpl;
}

namespace fsdp_train {

// The MoE blocks of a model, in module order (layers.0.moe, layers.1.moe, ...); empty for a dense model.
std::vector<fsdp::models::moe::MoEImpl*> moe_layers(torch::nn::Module& model);

struct ExpertLoad {
  // Per MoE layer: the fewest and most tokens one expert received in the step (summed over the ranks), the mean.
  std::vector<double> min_tokens, max_tokens, mean_tokens;
  // Over every layer and rank: the fewest tokens an expert received from one rank's batch (0: some expert had
  // none from some rank).
  double min_local_tokens = 0;
  // Sum of |expert_bias| over every layer after the update (moves iff the bias is on and the load uneven).
  double bias_l1 = 0;
  bool empty() const { return min_tokens.empty(); }
};

// Sums the layers' token counts over `dp_group` (null: one process), updates every layer's expert_bias from them
// (a no-op for layers without load balancing) and zeroes the counts. Collective over `dp_group`.
ExpertLoad update_expert_load_balance(const std::vector<fsdp::models::moe::MoEImpl*>& layers,
                                      const fsdp::ProcessGroupPtr& dp_group);

// The same under pipeline parallelism, where each stage's MoE layers live only on that stage's ranks: `layers` is
// every MoE layer of the whole model, `held[l]` whether this rank holds layer l (its stages). The held layers'
// counts are summed over `stage_dp_groups` (the mesh dims of this stage's data-parallel ranks, experts' ranks
// included: each dim's group in turn), their bias updated from that sum; the other layers' figures then come from
// their holders over `pp_group` (sum: each layer has one holder there), so that every rank reports every layer.
// The layers this rank does not hold are not touched (they may still be on `meta`). Collective over the groups.
ExpertLoad update_expert_load_balance(const std::vector<fsdp::models::moe::MoEImpl*>& layers,
                                      const std::vector<bool>& held,
                                      const std::vector<fsdp::ProcessGroupPtr>& stage_dp_groups,
                                      const fsdp::ProcessGroupPtr& pp_group);

// Pipeline parallelism and DeepSeek-V3's sequence balance loss, the metric: adds (detached) `layers`' balance
// losses of their last (this microbatch's) training forward, times `share`, to `sum`. The gradient needs nothing
// here: each MoE layer ties its loss to its own output (MoEImpl::set_aux_loss_grad_scale, TorchTitan's autograd
// function), so it reaches backward through the stage's graph (also under activation checkpointing, from the
// recomputation) without going through the pipeline's outputs. `share`: the microbatch's share of the batch (its
// sequences / global_batch_size), so that the microbatches of every rank add up to the batch's mean, as without
// PP. Nothing when gradients are off (validation).
void record_sequence_aux_loss(const std::vector<fsdp::models::moe::MoEImpl*>& layers, double share, at::Tensor& sum);

}  // namespace fsdp_train
