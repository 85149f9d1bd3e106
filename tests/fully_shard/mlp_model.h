#pragma once
// The small MLP most fully_shard tests train (and the device tests, which must not include fsdp_test_util.h:
// its comm/dist_env.h joins a CPU Gloo world). Plain libtorch modules; blocks are called through
// fsdp::nn::call so FSDP's hooks run.

#include <fsdp/nn/module_call.h>

#include <torch/torch.h>

#include <cstdint>

namespace fsdp_test {

// One block: Linear -> ReLU -> Linear with a residual when shapes allow.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// in -> blocks -> out. Layer sizes are deliberately not multiples of common world sizes (uneven shards).
struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t in, int64_t dim, int64_t hidden, int64_t out, int64_t n_blocks) {
    input = register_module("input", torch::nn::Linear(in, dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(Block(dim, hidden));
    output = register_module("output", torch::nn::Linear(dim, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(input(x));
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<BlockImpl>(i);
      x = fsdp::nn::call(block, x);
    }
    return output(x);
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(MLP);

inline MLP make_mlp(uint64_t seed, int64_t n_blocks = 3) {
  torch::manual_seed(seed);
  return MLP(7, 19, 13, 5, n_blocks);
}

}  // namespace fsdp_test
