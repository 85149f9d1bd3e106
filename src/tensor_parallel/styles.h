#pragma once
// One function per parallel style: shard the module's parameters over the TP mesh and install the forward
// hooks that move activations between layouts (see <fsdp/tensor_parallel.h> for the collectives each implies).

#include <fsdp/tensor_parallel.h>

#include <torch/nn/module.h>

#include <string>

namespace fsdp::tp {

// What a style needs to know about a module: which layout its "weight" has.
enum class ModuleKind { Linear, Embedding, Other };
// Linear: torch::nn::Linear, or a module declaring nn::WeightLayout::Linear (weight [out, in], optional bias [out]);
// Embedding: torch::nn::Embedding, or a module declaring nn::WeightLayout::Embedding (weight [num, dim]).
// (<fsdp/nn/weight_layout.h>: a model's own layers state their layout; this layer knows no model class.)
ModuleKind module_kind(const torch::nn::Module& module);

// `fqn` names the module in errors.
void apply_colwise(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                   const ColwiseParallel& style);
void apply_rowwise(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                   const RowwiseParallel& style);
void apply_sequence_parallel(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                             const SequenceParallel& style);
void apply_prepare_module_input(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                                const PrepareModuleInput& style);

}  // namespace fsdp::tp
