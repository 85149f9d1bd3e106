// A complete libfsdp program: shard a small model over every rank, train it, check the loss fell.
// Build: part of the project (examples/), or in your own CMake project with
//   find_package(libfsdp REQUIRED)  target_link_libraries(app PRIVATE fsdp::fsdp)
// Run:   fsdprun --nproc-per-node 2 ./train_mlp
#include <fsdp/clip_grad.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <iostream>

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    up = register_module("up", torch::nn::Linear(dim, 4 * dim));
    down = register_module("down", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t in, int64_t dim, int64_t n_blocks) {
    embed = register_module("embed", torch::nn::Linear(in, dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(Block(dim));
    head = register_module("head", torch::nn::Linear(dim, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<BlockImpl>(i);
      x = fsdp::nn::call(block, x);  // the hook rule: sharded submodules are called through fsdp::nn::call
    }
    return head(x);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

int main() {
  auto world = fsdp::init_process_group();  // reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by fsdprun)
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});

  torch::manual_seed(0);  // same initial weights everywhere; each rank keeps only its shard
  Net net(16, 32, 4);
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  for (size_t i = 0; i < net->blocks->size(); ++i) fsdp::fully_shard(net->blocks[i], options);  // bottom-up
  fsdp::fully_shard(net, options);                                                               // then the root

  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(3e-3));  // on the shards
  torch::manual_seed(1 + world->rank());  // each rank draws its own data
  const auto target_w = torch::ones({16, 1}) / 4;
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    auto x = torch::randn({32, 16});
    auto y = torch::sin(x.matmul(target_w));
    optimizer.zero_grad();
    auto loss = torch::mse_loss(fsdp::nn::call(net, x), y);  // the root too
    loss.backward();                                        // gradients are reduce-scattered to shards
    fsdp::clip_grad_norm_(*net, 1.0);                       // global norm across all shards
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  if (world->rank() == 0) std::cout << "loss " << first << " -> " << last << "\n";
  world->barrier().wait();
  fsdp::destroy_process_group();
  return last < first / 2 ? 0 : 1;
}
