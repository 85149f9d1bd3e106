#pragma once
// MoE load balancing between steps (TorchTitan's optimizer step pre-hook, components/optimizer/optimizer.py): the
// tokens each expert received in this step's forwards, summed over the data-parallel ranks in one collective for
// all layers, drive DeepSeek-V3's aux-loss-free bias update of every MoE layer; the same counts are the step's
// expert-load metrics.

#include <fsdp/process_group.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

namespace fsdp::nn::moe {
class MoEImpl;
}

namespace fsdp_train {

// The MoE blocks of a model, in module order (layers.0.moe, layers.1.moe, ...); empty for a dense model.
std::vector<fsdp::nn::moe::MoEImpl*> moe_layers(torch::nn::Module& model);

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
ExpertLoad update_expert_load_balance(const std::vector<fsdp::nn::moe::MoEImpl*>& layers,
                                      const fsdp::ProcessGroupPtr& dp_group);

}  // namespace fsdp_train
