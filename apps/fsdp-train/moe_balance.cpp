// See moe_balance.h.
#include "moe_balance.h"

#include <fsdp/models/moe.h>

#include <ATen/ATen.h>

namespace fsdp_train {

std::vector<fsdp::nn::moe::MoEImpl*> moe_layers(torch::nn::Module& model) {
  std::vector<fsdp::nn::moe::MoEImpl*> out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* moe = m->as<fsdp::nn::moe::MoEImpl>()) out.push_back(moe);
  }
  return out;
}

ExpertLoad update_expert_load_balance(const std::vector<fsdp::nn::moe::MoEImpl*>& layers,
                                      const fsdp::ProcessGroupPtr& dp_group) {
  ExpertLoad load;
  if (layers.empty()) return load;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> rows;
  for (auto* moe : layers) rows.push_back(moe->tokens_per_expert().to(at::kCPU, at::kDouble));
  const at::Tensor local = at::stack(rows);  // [layers, E]
  // One all-reduce for every layer (tt#1593), a second for the local minimum.
  at::Tensor global = local.clone();
  at::Tensor local_min = local.min().reshape({1});
  if (dp_group && dp_group->size() > 1) {
    // On the group's device (NCCL takes CUDA tensors only), back to the host for the figures below.
    global = global.to(dp_group->device());
    local_min = local_min.to(dp_group->device());
    dp_group->all_reduce(global, fsdp::ReduceOp::Sum).wait();
    dp_group->all_reduce(local_min, fsdp::ReduceOp::Min).wait();
    global = global.cpu();
    local_min = local_min.cpu();
  }
  load.min_local_tokens = local_min.item<double>();
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor c = global[static_cast<int64_t>(l)];
    load.min_tokens.push_back(c.min().item<double>());
    load.max_tokens.push_back(c.max().item<double>());
    load.mean_tokens.push_back(c.mean().item<double>());
    layers[l]->update_expert_bias(c.to(at::kFloat));
    if (layers[l]->expert_bias.defined()) load.bias_l1 += layers[l]->expert_bias.abs().sum().item<double>();
  }
  return load;
}

}  // namespace fsdp_train
