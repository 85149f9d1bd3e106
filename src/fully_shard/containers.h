#pragma once
// Containers whose forward dispatches to their elements without the FSDP hooks.

#include <torch/nn/module.h>

namespace fsdp::detail {

// Fails (before fully_shard changes anything) when `module`'s subtree, `module` included, contains a
// torch::nn::Sequential with an element that was given to fully_shard: libtorch's Sequential::forward calls
// each element's forward() directly, so that element would compute with its shards. The message names the
// element's path and what to write instead (fsdp::nn::Sequential, sharding the whole Sequential, or a
// ModuleList whose elements the parent calls with fsdp::nn::call).
//
// fully_shard is applied bottom-up, so this fires at the first fully_shard of an ancestor of the Sequential.
// A model in which no ancestor of the Sequential is ever sharded cannot be checked here; its first forward
// raises libtorch's shape error (docs/hooks.md).
void check_container_dispatch(const torch::nn::Module& module);

}  // namespace fsdp::detail
