#include "fully_shard/containers.h"

#include "fully_shard/state_holder.h"

#include <torch/nn/modules/container/sequential.h>

namespace fsdp::detail {

void check_container_dispatch(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(item.value().get());
    if (!sequential) continue;
    for (const auto& element : sequential->named_children()) {
      if (!find_state(*element.value())) continue;
      const std::string seq_path = item.key().empty() ? std::string("<the module given to fully_shard>") : item.key();
      const std::string path = item.key().empty() ? element.key() : item.key() + "." + element.key();
      TORCH_CHECK(false, "fully_shard: '", path, "' (", element.value()->name(), ") was given to fully_shard, but it ",
                  "is an element of the torch::nn::Sequential '", seq_path, "', whose forward() calls each element's ",
                  "forward() directly, without the FSDP hooks: that element would compute with its parameter ",
                  "shards. Write instead one of: (1) fsdp::nn::Sequential (#include <fsdp/nn/sequential.h>), a ",
                  "drop-in that runs every element through fsdp::nn::call, with the same element names (convert ",
                  "an existing one with fsdp::nn::Sequential(std::move(torch_sequential))); (2) fully_shard the ",
                  "whole Sequential instead of its elements; (3) a torch::nn::ModuleList whose elements the parent ",
                  "calls with fsdp::nn::call(list->ptr<T>(i), x). Nothing was sharded by this call.");
    }
  }
}

}  // namespace fsdp::detail
