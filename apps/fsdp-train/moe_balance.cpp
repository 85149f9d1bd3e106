// See moe_balance.h.
#include "moe_balance.h"

#include <fsdp/models/moe.h>

#include <ATen/ATen.h>

#include <limits>

namespace fsdp_train {

std::vector<fsdp::models::moe::MoEImpl*> moe_layers(torch::nn::Module& model) {
  std::vector<fsdp::models::moe::MoEImpl*> out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* moe = m->as<fsdp::models::moe::MoEImpl>()) out.push_back(moe);
  }
  return out;
}

namespace {

// Sums (or takes the minimum of) `t` over `group` on the group's device (NCCL takes CUDA tensors only); back on
// the host. `t` itself without a group of more than one rank.
at::Tensor all_reduced(const at::Tensor& t, const fsdp::ProcessGroupPtr& group, fsdp::ReduceOp op) {
  if (!group || group->size() <= 1) return t;
  at::Tensor on_device = t.to(group->device());
  group->all_reduce(on_device, op).wait();
  return on_device.cpu();
}

}  // namespace

ExpertLoad update_expert_load_balance(const std::vector<fsdp::models::moe::MoEImpl*>& layers,
                                      const fsdp::ProcessGroupPtr& dp_group) {
  return update_expert_load_balance(layers, std::vector<bool>(layers.size(), true), {dp_group}, nullptr);
}

ExpertLoad update_expert_load_balance(const std::vector<fsdp::models::moe::MoEImpl*>& layers,
                                      const std::vector<bool>& held,
                                      const std::vector<fsdp::ProcessGroupPtr>& stage_dp_groups,
                                      const fsdp::ProcessGroupPtr& pp_group) {
  ExpertLoad load;
  if (layers.empty()) return load;
  TORCH_CHECK(held.size() == layers.size(), "update_expert_load_balance: ", held.size(), " held flags for ",
              layers.size(), " MoE layers");
  at::NoGradGuard no_grad;
  const int64_t num_experts = layers.front()->options().num_experts;
  std::vector<at::Tensor> rows;
  bool holds_any = false;
  for (size_t l = 0; l < layers.size(); ++l) {
    TORCH_CHECK(layers[l]->options().num_experts == num_experts, "update_expert_load_balance: MoE layer ", l, " has ",
                layers[l]->options().num_experts, " experts, layer 0 ", num_experts);
    holds_any = holds_any || held[l];
    rows.push_back(held[l] ? layers[l]->tokens_per_expert().to(at::kCPU, at::kDouble)
                           : at::zeros({num_experts}, at::kDouble));
  }
  const at::Tensor local = at::stack(rows);  // [layers, E]; zero rows for the layers of other stages
  // One all-reduce per group for every layer (tt#1593), a second for the local minimum (over the held layers; a
  // rank without MoE layers contributes nothing to it).
  at::Tensor held_rows = at::zeros({static_cast<int64_t>(layers.size())}, at::kBool);
  for (size_t l = 0; l < layers.size(); ++l) held_rows[static_cast<int64_t>(l)] = static_cast<bool>(held[l]);
  at::Tensor global = local.clone();
  at::Tensor local_min = (holds_any ? local.index({held_rows}).min()
                                    : at::full({}, std::numeric_limits<double>::infinity(), at::kDouble))
                             .reshape({1});
  for (const auto& group : stage_dp_groups) {
    global = all_reduced(global, group, fsdp::ReduceOp::Sum);
    local_min = all_reduced(local_min, group, fsdp::ReduceOp::Min);
  }
  // The bias of the held layers, from their stage's sum (what every rank of the stage computes alike).
  double held_bias_l1 = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (!held[l]) continue;
    layers[l]->update_expert_bias(global[static_cast<int64_t>(l)].to(at::kFloat));
    if (layers[l]->expert_bias.defined()) held_bias_l1 += layers[l]->expert_bias.abs().sum().item<double>();
  }
  // The other stages' layers from their holders (one per layer over the pipeline ranks).
  at::Tensor bias_l1 = at::full({1}, held_bias_l1, at::kDouble);
  global = all_reduced(global, pp_group, fsdp::ReduceOp::Sum);
  local_min = all_reduced(local_min, pp_group, fsdp::ReduceOp::Min);
  bias_l1 = all_reduced(bias_l1, pp_group, fsdp::ReduceOp::Sum);
  load.min_local_tokens = local_min.item<double>();
  load.bias_l1 = bias_l1.item<double>();
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor c = global[static_cast<int64_t>(l)];
    load.min_tokens.push_back(c.min().item<double>());
    load.max_tokens.push_back(c.max().item<double>());
    load.mean_tokens.push_back(c.mean().item<double>());
  }
  return load;
}

void record_sequence_aux_loss(const std::vector<fsdp::models::moe::MoEImpl*>& layers, double share, at::Tensor& sum) {
  if (!at::GradMode::is_enabled()) return;  // validation
  at::NoGradGuard no_grad;
  at::Tensor aux;
  for (auto* moe : layers) {
    const at::Tensor& a = moe->aux_loss();
    if (!a.defined()) continue;
    const at::Tensor value = a.detach().to(at::kDouble);
    aux = aux.defined() ? aux + value : value;
  }
  if (!aux.defined()) return;
  aux = aux * share;  // on the device: read once per step
  sum = sum.defined() ? sum + aux : aux;
}

}  // namespace fsdp_train
