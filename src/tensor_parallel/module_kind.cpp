// Which parameter layout a module has, for the styles that shard "weight" (Linear vs Embedding).

#include "tensor_parallel/styles.h"

#include <fsdp/nn/llama.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace fsdp::tp {

ModuleKind module_kind(const torch::nn::Module& module) {
  if (dynamic_cast<const torch::nn::LinearImpl*>(&module) || dynamic_cast<const nn::llama::LinearImpl*>(&module)) {
    return ModuleKind::Linear;
  }
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&module) ||
      dynamic_cast<const nn::llama::EmbeddingImpl*>(&module)) {
    return ModuleKind::Embedding;
  }
  return ModuleKind::Other;
}

}  // namespace fsdp::tp
