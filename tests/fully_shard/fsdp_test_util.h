#pragma once
// Shared pieces of the fully_shard tests: small models, a single-process reference trainer, and a way to
// read an FSDP model's full parameters. The reference is plain libtorch on one process, trained on the
// whole global batch — it shares no code with fully_shard.

#include "comm/dist_env.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/state_dict.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

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

// fully_shard every block, then the root (bottom-up), with the same options.
inline std::vector<fsdp::FSDPModule> shard_mlp(MLP& model, const fsdp::FullyShardOptions& opts) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], opts));
  units.push_back(fsdp::fully_shard(model, opts));
  return units;
}

// Deterministic global batch for step `step`: every rank can build it.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t batch, int64_t in, int64_t out) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({batch, in}, gen);
  auto y = torch::randn({batch, out}, gen);
  return {x, y};
}

// All parameters of an FSDP model gathered to full tensors, by FQN: the fp32 sharded (master) parameters,
// all-gathered one by one (full_state_dict), on every rank.
inline std::map<std::string, torch::Tensor> full_params(torch::nn::Module& root, const std::vector<fsdp::FSDPModule>&) {
  return fsdp::full_state_dict(root, {/*cpu_offload=*/true, /*rank0_only=*/false});
}

inline double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(denom, 1e-12);
}

}  // namespace fsdp_test
