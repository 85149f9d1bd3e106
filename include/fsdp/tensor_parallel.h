#pragma once
// Tensor parallel (Megatron-style), PyTorch's torch.distributed.tensor.parallel for libtorch module trees.
//
//   auto tp = mesh["tp"];
//   fsdp::parallelize_module(model, tp, {
//       {"layers.*.attention.wq", fsdp::ColwiseParallel{}},
//       {"layers.*.attention.wo", fsdp::RowwiseParallel{}},
//   });
//   // then, optionally, fully_shard over the data-parallel mesh (TP first, as in PyTorch)
//
// There is no DTensor subclass in libtorch: a TP-sharded parameter stays the module's own tensor (same
// identity), now holding this rank's piece; its global shape and placement over the TP mesh are recorded on
// the module (tensor_parallel_spec) for fully_shard, state dicts and checkpoints. Activations flow between
// modules as plain local tensors; each style knows the layout it receives and produces (its input/output
// layouts) and runs the implied collectives as autograd functions through the module's forward hooks, so the
// model code is unchanged. Modules given a style must be invoked through fsdp::nn::call (the hook rule).
//
// Layouts use ShardedTensor's vocabulary: Shard(d), Replicate(). Collectives per style (forward | backward):
//   ColwiseParallel  input Replicate: none | all-reduce of the input gradient (skipped when the input came
//                    from a PrepareModuleInput, whose backward reduces it); input Shard(d): all-gather |
//                    reduce-scatter; output Replicate: all-gather | none.
//   RowwiseParallel  output Replicate: all-reduce | none; output Shard(d): reduce-scatter | all-gather.
//   SequenceParallel none | all-reduce of each parameter's gradient (the norm's weight sees a slice of the
//                    sequence on each rank).
//   PrepareModuleInput  Shard(d) -> Replicate: all-gather | reduce-scatter.
// Activation dims that a style shards or gathers must divide by the TP degree (TorchTitan: seq_len % tp == 0);
// parameters may be uneven (torch.chunk sizes, as DTensor).

#include <fsdp/device_mesh.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/sharded_tensor.h>
#include <fsdp/tensor_parallel_spec.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fsdp {

// "Linear" and "Embedding" below: torch::nn::Linear / torch::nn::Embedding, or a module of any class that states
// its weight's layout by deriving from fsdp::nn::HasWeightLayout (<fsdp/nn/weight_layout.h>; the Llama model's
// own layers do).

// Linear: weight (and bias) Shard(0) — output features split; Embedding: weight Shard(1).
// Input is made input_layout -> Replicate; output leaves as Shard(-1) or is gathered to output_layout.
struct ColwiseParallel {
  Placement input_layout = Replicate();
  Placement output_layout = Shard(-1);
  // Input Replicate from a module that is not a PrepareModuleInput: whether the input gradient (each rank's covers
  // only its output features: Partial) is all-reduced here. false leaves it Partial for a replicated producer whose
  // parameters all-reduce their own gradients (SequenceParallel on it), as DTensor does for TorchTitan's NoParallel
  // modules (DeepSeek-V3's wkv_a / kv_norm before wkv_b): summed once there, not here and again there.
  bool reduce_input_grad = true;
};

// Linear: weight Shard(1) (input features split), bias Replicate; input Shard(-1). Embedding: weight Shard(0)
// (vocabulary split), input Replicate (token ids). The partial output is all-reduced (output Replicate) or
// reduce-scattered (output Shard(d), sequence parallel).
struct RowwiseParallel {
  std::optional<Placement> input_layout;  // nullopt: Shard(-1) for Linear, Replicate() for Embedding
  Placement output_layout = Replicate();
};

// Norms (any module whose parameters act elementwise on the last dim): parameters Replicate, input and output
// Shard(sequence_dim) — computed on this rank's slice of the sequence.
struct SequenceParallel {
  int64_t sequence_dim = 1;
};

// Redistributes the module's tensor inputs (in order) from input_layouts to desired_input_layouts; nullopt
// entries (and missing trailing ones) pass through untouched. The module's colwise children then know their
// input is already gathered.
struct PrepareModuleInput {
  std::vector<std::optional<Placement>> input_layouts;
  std::vector<std::optional<Placement>> desired_input_layouts;
};

// ExpertParallel (<fsdp/expert_parallel.h>): routed experts split on dim 0, tokens exchanged by all-to-all.
using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, ExpertParallel>;

// FQN pattern -> style, applied in order. Patterns match a module's FQN relative to the module given to
// parallelize_module, dot-separated, each segment fnmatch-style ('*' matches within a segment: "layers.*.
// attention.wq"). The empty pattern "" names the module itself. A pattern that matches nothing is an error.
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

// Shards the matched modules' parameters over `tp_mesh` (1-D) in place and installs the styles' hooks.
// Collective-free: every rank must hold the same full parameters before (same seed or a broadcast), and keeps
// its piece. Apply it before fully_shard.
void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan);
template <class Holder, class = decltype(std::declval<Holder>().ptr())>
void parallelize_module(const Holder& module, const DeviceMesh& tp_mesh, const ParallelizePlan& plan) {
  parallelize_module(std::static_pointer_cast<torch::nn::Module>(module.ptr()), tp_mesh, plan);
}

// What parallelize_module records for each parameter it shards (TensorParallelSpec, tensor_parallel_spec()):
// <fsdp/tensor_parallel_spec.h>.

enum class LossReduction { Mean, Sum };

// Cross entropy (mean or sum over targets != ignore_index, as torch.nn.functional.cross_entropy) on logits whose
// last (class) dim is sharded over the 1-D `tp_mesh` as Shard(-1) — ColwiseParallel's local output — without
// gathering them: 3 all-reduces of [tokens] scalars (max, sum of exponentials, target logit) in forward, none
// in backward. PyTorch's loss_parallel(). `local_logits`: [..., V/tp] (this rank's classes, torch.chunk
// order); `target`: [...] global class ids. Every rank returns the same loss.
at::Tensor loss_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                       const DeviceMesh& tp_mesh, int64_t ignore_index = -100,
                                       LossReduction reduction = LossReduction::Mean);

}  // namespace fsdp
