#pragma once
// A mixture-of-experts feed-forward block with TorchTitan's semantics (torchtitan/models/moe; facts in
// shared/reference/moe-expert-parallel.md): a token-choice top-k router (softmax or sigmoid scores, optional
// normalisation of the chosen scores and a route scale), DeepSeek-V3's auxiliary-loss-free load balancing (a
// per-expert bias used only to choose experts, updated between steps from the tokens each expert received),
// routed experts stored as stacked weights (one tensor per projection, experts on dim 0) computed with grouped
// GEMM (at::_grouped_mm), and optional shared experts. The expert weights are applied after the experts, as
// TorchTitan's Qwen3 / DeepSeek-V3 flavors do.
//
// Expert parallelism: fsdp::apply_expert_parallel(moe->experts, ep_mesh) (<fsdp/expert_parallel.h>) splits the
// experts over ranks; the block calls its experts through fsdp::nn::call, so nothing here changes.
//
// FQNs (TorchTitan's TOML-era names): router.gate.weight [E, D]; experts.w1 [E, F, D], experts.w2 [E, D, F],
// experts.w3 [E, F, D]; shared_experts.w1/w2/w3.weight; buffer expert_bias [E] (when load balancing is on).

#include <fsdp/nn/weight_layout.h>
#include <fsdp/process_group.h>

#include <ATen/core/TensorBody.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::models::moe {

struct MoEOptions {
  int64_t dim = 0;
  int64_t hidden = 0;        // F of each routed expert
  int64_t num_experts = 8;   // E
  int64_t top_k = 1;
  std::string score_func = "sigmoid";  // "sigmoid" | "softmax"
  bool route_norm = false;             // divide the chosen scores by their sum (Qwen3's norm_topk_prob)
  double route_scale = 1.0;
  // DeepSeek-V3's group-limited routing (TorchTitan's num_expert_groups / num_limited_groups): the experts form
  // `num_expert_groups` groups of E / groups; each token ranks the groups by the sum of their two best choice
  // scores and picks its top-k experts only inside its `num_limited_groups` best groups. 0 = off.
  int64_t num_expert_groups = 0;
  int64_t num_limited_groups = 0;
  // Aux-loss-free load balancing: the bias step size (TorchTitan's load_balance_coeff, 1e-3); nullopt = off.
  std::optional<double> load_balance_coeff = 1e-3;
  int64_t num_shared_experts = 0;  // shared SwiGLU on every token with hidden F x this
  // DeepSeek-V3's sequence-wise balance loss, alpha (1e-4 there); nullopt = off. For each sequence:
  // alpha * sum_i f_i P_i with f_i = E / (k S) * (tokens choosing i), P_i = mean over the tokens of i's score
  // normalised per token; the mean over the sequences is aux_loss() after a training forward.
  std::optional<double> sequence_aux_loss_coeff;
  bool use_grouped_mm = true;      // false: a loop over the experts (the reference the benchmark compares with)
};

// A linear projection without bias, weight [out, in] (y = x W^T), created directly with the given tensor options
// (device, dtype): the router gate and the shared experts' w1 / w2 / w3. torch::nn::Linear would build and
// initialise its weight on the CPU first, which for a meta build of a large MoE model costs gigabytes; every
// weight here is filled by MoE::init_weights. A Linear to the tensor-parallel styles (HasWeightLayout).
class ProjectionImpl : public torch::nn::Module, public fsdp::nn::HasWeightLayout {
 public:
  ProjectionImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  fsdp::nn::WeightLayout weight_layout() const override { return fsdp::nn::WeightLayout::Linear; }
  at::Tensor weight;
};
TORCH_MODULE(Projection);

// The router's decision for T tokens.
struct Routing {
  at::Tensor expert_ids;  // [T, k] int64
  at::Tensor weights;     // [T, k] fp32: the original scores (no bias), normalised / scaled as configured
  at::Tensor scores;      // [T, E] fp32: sigmoid or softmax of the gate logits
};

class TokenChoiceRouterImpl : public torch::nn::Module {
 public:
  // Parameters created with `tensor_options` (device, dtype), as for every module of the block.
  explicit TokenChoiceRouterImpl(const MoEOptions& options, const at::TensorOptions& tensor_options = {});
  // x [T, D]; `expert_bias` [E] (or undefined) shifts the choice only.
  Routing forward(const at::Tensor& x, const at::Tensor& expert_bias);
  Projection gate{nullptr};

 private:
  MoEOptions options_;
};
TORCH_MODULE(TokenChoiceRouter);

class GroupedExpertsImpl : public torch::nn::Module {
 public:
  explicit GroupedExpertsImpl(const MoEOptions& options, const at::TensorOptions& tensor_options = {});
  // x [R, D], rows grouped by expert in ascending order, `counts` [E] rows per expert (int64) -> [R, D]:
  // w2 (silu(w1 x) * w3 x) of each row's expert.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& counts);
  at::Tensor w1, w2, w3;

 private:
  bool use_grouped_mm_;
};
TORCH_MODULE(GroupedExperts);

class MoEImpl : public torch::nn::Module {
 public:
  // Every parameter is created with `tensor_options` (the model's device and dtype: meta for a planning or
  // meta-init build, which then allocates nothing) and left uninitialised until init_weights; the buffers
  // (expert_bias) on that device in float32 (the bias accumulates small steps).
  explicit MoEImpl(const MoEOptions& options, const at::TensorOptions& tensor_options = {});
  // x [..., D] -> [..., D]. In a training forward the tokens each expert received are added to
  // tokens_per_expert() once: in a forward with gradients, or in activation checkpointing's first pass (with or
  // without gradients), never in its recomputation (fsdp::current_checkpoint_pass), so full, layer-selective and
  // op-level selective AC count what a run without AC counts. An evaluation or no-grad forward counts nothing.
  at::Tensor forward(const at::Tensor& x);
  // DeepSeek-V3's bias update (TorchTitan: an optimizer step pre-hook): delta = coeff * sign(mean(c) - c),
  // centred to mean 0, added to expert_bias; the counts are then zeroed. `counts` defaults to this block's own
  // (pass the sum over data-parallel ranks when distributed). No-op without load balancing.
  void update_expert_bias(const at::Tensor& counts = {});
  const at::Tensor& tokens_per_expert() const { return tokens_per_expert_; }
  // The sequence-wise balance loss of the last training forward (0-dim, differentiable through the router's
  // scores; add it to the loss); undefined when off or after an evaluation forward.
  const at::Tensor& aux_loss() const { return aux_loss_; }
  // TorchTitan's way of training with the balance loss (an autograd function in the MoE layer): with a scale set,
  // a forward with gradients ties scale * aux_loss() to the block's output, whose backward then adds its gradient
  // (d(scale * aux) / d(router)) as if it had been added to the loss. The caller must then not add aux_loss() to
  // the loss itself. Needed under activation checkpointing: the gradient comes from the graph the backward really
  // differentiates (the recomputation), once, while aux_loss() of the first pass holds the value (without a graph
  // under full AC). nullopt (the default) = not tied; the caller adds aux_loss() to its loss.
  void set_aux_loss_grad_scale(std::optional<double> scale) { aux_loss_grad_scale_ = scale; }
  std::optional<double> aux_loss_grad_scale() const { return aux_loss_grad_scale_; }
  // Sequence parallelism (a tensor-parallel plan that keeps the tokens sequence-sharded through the block): the
  // input holds this rank's slice of each sequence, the other slices are on the other ranks of `group`. The
  // balance loss is defined on whole sequences (TorchTitan computes it there), so its per-sequence expert counts
  // are summed over `group` (indicators: no gradient) and aux_loss() is this rank's share, its tokens' scores
  // against the whole sequences' counts: the shares sum over `group` to the sequences' loss, and each share's
  // gradient is that loss's for this rank's tokens. A collective over `group` in every training forward with the
  // loss on (every rank of the group runs the block alike, as tensor parallelism needs anyway). Null (the
  // default): the input holds whole sequences.
  void set_sequence_parallel_group(ProcessGroupPtr group) { sequence_group_ = std::move(group); }
  const MoEOptions& options() const { return options_; }
  // Deterministic init from a generator (TorchTitan: trunc_normal(std) on the gate and the experts).
  void init_weights(at::Generator& gen, double std = 0.02);

  TokenChoiceRouter router{nullptr};
  GroupedExperts experts{nullptr};
  std::shared_ptr<torch::nn::Module> shared_experts;  // w1, w2, w3 Projections (no bias); null when none
  at::Tensor expert_bias;                             // buffer [E] fp32 (undefined without load balancing)

 private:
  MoEOptions options_;
  at::Tensor tokens_per_expert_;  // [E] fp32, not part of the state dict (TorchTitan: non-persistent)
  at::Tensor aux_loss_;
  std::optional<double> aux_loss_grad_scale_;
  ProcessGroupPtr sequence_group_;
};
TORCH_MODULE(MoE);

}  // namespace fsdp::models::moe
