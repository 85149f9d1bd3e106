// Which parameter layout a module has, for the styles that shard "weight" (Linear vs Embedding). Generic: the
// tensor-parallel layer knows libtorch's own layers and the fsdp::nn::HasWeightLayout interface, no model class.

#include "tensor_parallel/styles.h"

#include <fsdp/nn/weight_layout.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace fsdp::tp {

ModuleKind module_kind(const torch::nn::Module& module) {
  if (dynamic_cast<const torch::nn::LinearImpl*>(&module)) return ModuleKind::Linear;
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&module)) return ModuleKind::Embedding;
  if (const auto* declared = dynamic_cast<const nn::HasWeightLayout*>(&module)) {
    switch (declared->weight_layout()) {
      case nn::WeightLayout::Linear:
        return ModuleKind::Linear;
      case nn::WeightLayout::Embedding:
        return ModuleKind::Embedding;
    }
  }
  return ModuleKind::Other;
}

}  // namespace fsdp::tp
