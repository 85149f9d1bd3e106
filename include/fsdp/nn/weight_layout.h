#pragma once
// How a module uses its parameter "weight": what code that splits parameters needs to know about a module
// without knowing its class (the tensor-parallel styles: ColwiseParallel splits a Linear weight's rows but an
// Embedding weight's columns). PyTorch's styles ask isinstance(module, nn.Linear / nn.Embedding); here
// torch::nn::Linear and torch::nn::Embedding are known by type, and a module of any other class (a model's own
// linear layer, say) states its layout by also deriving from HasWeightLayout. The model describes itself; it
// learns nothing about parallelism (docs/architecture.md).

namespace fsdp::nn {

enum class WeightLayout {
  Linear,     // weight [out_features, in_features], y = x W^T (+ bias [out_features] when the module has one)
  Embedding,  // weight [num_embeddings, embedding_dim], y = weight[ids]
};

class HasWeightLayout {
 public:
  virtual ~HasWeightLayout() = default;
  virtual WeightLayout weight_layout() const = 0;

 protected:
  HasWeightLayout() = default;
  HasWeightLayout(const HasWeightLayout&) = default;
  HasWeightLayout& operator=(const HasWeightLayout&) = default;
};

}  // namespace fsdp::nn
