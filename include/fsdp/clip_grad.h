#pragma once
// Global-norm gradient clipping for FSDP-sharded models. Each rank holds only its shard of every gradient,
// so the norm is reduced across the shard group before clipping: the result equals clipping the full,
// unsharded gradients (PyTorch issue 170862 is about the local-norm mistake this avoids).

#include <ATen/core/Tensor.h>
#include <fsdp/process_group.h>

#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace fsdp {

// Clips the gradients of root.parameters() in place so that their global norm is at most max_norm.
// Returns the total (pre-clipping) norm as a 0-dim fp32 tensor. norm_type: any p > 0 (2.0, 1.0, 3.0, 0.5, ...) or
// infinity (max-norm), as torch::nn::utils::clip_grad_norm_; p <= 0 and NaN are errors (torch returns values
// that are no size of the gradients for them).
// Collective: every rank of the model's meshes must call it.
at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm, double norm_type = 2.0);

// The same over several model parts (the pipeline stages this rank holds) and, when `across` is given, over the
// ranks of that group (the pipeline group: every pp rank holds other parameters): the norm of every gradient of
// the whole model, and every part clipped by it (TorchTitan's clip_grad_norm_ with pp_mesh).
at::Tensor clip_grad_norm_(const std::vector<std::shared_ptr<torch::nn::Module>>& parts, double max_norm,
                           double norm_type = 2.0, const ProcessGroupPtr& across = nullptr);

}  // namespace fsdp
