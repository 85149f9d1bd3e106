#pragma once
// A small transformer-like model for the activation checkpointing tests: per block LayerNorm, q/k/v
// projections, two bmm (attention), dropout on the attention weights, and a feed-forward child module with its
// own dropout, called through fsdp::nn::call. 7 matmuls per block: wq, wk, wv (addmm), 2 bmm, w1, w2 (addmm).

#include <fsdp/nn/module_call.h>

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

namespace ac_test {

constexpr int64_t kMatmulsPerBlock = 7;

struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl(int64_t dim, int64_t hidden) {
    w1 = register_module("w1", torch::nn::Linear(dim, hidden));
    w2 = register_module("w2", torch::nn::Linear(hidden, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return w2(torch::dropout(torch::gelu(w1(x)), 0.2, is_training())); }
  torch::nn::Linear w1{nullptr}, w2{nullptr};
};
TORCH_MODULE(FeedForward);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t hidden) : dim_(dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    wq = register_module("wq", torch::nn::Linear(dim, dim));
    wk = register_module("wk", torch::nn::Linear(dim, dim));
    wv = register_module("wv", torch::nn::Linear(dim, dim));
    ffn = register_module("ffn", FeedForward(dim, hidden));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = norm(x);
    auto q = wq(h), k = wk(h), v = wv(h);
    auto att = torch::softmax(torch::bmm(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(dim_)), -1);
    att = torch::dropout(att, 0.1, is_training());
    x = x + torch::bmm(att, v);
    return x + fsdp::nn::call(ffn, x);
  }
  int64_t dim_;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr};
  FeedForward ffn{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  ModelImpl(int64_t in, int64_t dim, int64_t hidden, int64_t out, int64_t n_blocks) {
    input = register_module("input", torch::nn::Linear(in, dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(Block(dim, hidden));
    output = register_module("output", torch::nn::Linear(dim, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = input(x);
    for (size_t i = 0; i < blocks->size(); ++i) x = fsdp::nn::call(blocks->ptr<BlockImpl>(i), x);
    return output(x);
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Model);

// Sizes not multiples of 2 or 3 (uneven shards).
inline Model make_model(int64_t n_blocks = 4) {
  torch::manual_seed(11);
  return Model(5, 14, 23, 3, n_blocks);
}

// One step of a checkpointed run against the same step without checkpointing: the loss within 1e-6 and every
// gradient, by FQN, within 1e-6 of the gradient's scale. Returns the sum of the reference gradients' norms (the
// caller checks it is > 0: the reference moved).
inline double expect_same_step(double loss, double ref_loss, const std::map<std::string, torch::Tensor>& grads,
                               const std::map<std::string, torch::Tensor>& ref_grads, size_t step) {
  EXPECT_NEAR(loss, ref_loss, 1e-6 * std::max(1.0, std::abs(ref_loss))) << "step " << step;
  EXPECT_EQ(grads.size(), ref_grads.size()) << "step " << step;
  double total_norm = 0;
  for (const auto& [fqn, g] : ref_grads) {
    const auto it = grads.find(fqn);
    if (it == grads.end()) {
      ADD_FAILURE() << fqn << " has no gradient at step " << step;
      continue;
    }
    const torch::Tensor& h = it->second;
    if (h.sizes() != g.sizes()) {
      ADD_FAILURE() << fqn << ": gradient of shape " << h.sizes() << ", the reference's " << g.sizes();
      continue;
    }
    const double scale = std::max(1.0, g.abs().max().item<double>());
    EXPECT_LE((h - g).abs().max().item<double>(), 1e-6 * scale) << fqn << " step " << step;
    total_norm += g.norm().item<double>();
  }
  return total_norm;
}

}  // namespace ac_test
