#pragma once
// Shared pieces of the tests/nn tests (containers, call forms, holders): a block, the world mesh, a training
// loop for the FSDP side, and a single-process reference trainer that is plain libtorch (no fsdp code: its
// models call forward() directly, through torch::nn::Sequential where the FSDP side has fsdp::nn::Sequential).

#include "comm/dist_env.h"
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/device_mesh.h>
#include <fsdp/comm_stats.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/nn/sequential.h>
#include <fsdp/state_dict.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace nn_test {

using fsdp_test::test_world;

// Uneven sizes: none is a multiple of 2, 3 or 4 except by chance (uneven and empty trailing shards).
constexpr int64_t kIn = 7, kDim = 19, kHidden = 13, kOut = 5, kGlobalBatch = 24, kSteps = 6;

// Linear -> ReLU -> Linear with a residual: the fully_shard tests' block.
using fsdp_test::Block;
using fsdp_test::BlockImpl;

inline fsdp::DeviceMesh world_mesh() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {test_world()->size()}, {"shard"});
  return mesh;
}

inline fsdp::FullyShardOptions shard_options() {
  fsdp::FullyShardOptions o;
  o.mesh = world_mesh();
  return o;
}

// Deterministic global batch for `step`: every rank builds the same one.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({kGlobalBatch, kIn}, gen);
  auto y = torch::randn({kGlobalBatch, kOut}, gen);
  return {x, y};
}

enum class Opt { SGD, AdamW };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, std::vector<torch::Tensor> params) {
  if (opt == Opt::SGD) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

using Params = std::map<std::string, torch::Tensor>;

inline Params snapshot(const torch::nn::Module& model) {
  Params out;
  for (const auto& item : model.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// Copies `from`'s parameters into `to` by FQN; both must have exactly the same names and shapes.
inline void copy_params(const torch::nn::Module& from, torch::nn::Module& to) {
  auto src = from.named_parameters();
  auto dst = to.named_parameters();
  ASSERT_EQ(src.size(), dst.size());
  torch::NoGradGuard no_grad;
  for (const auto& item : src) {
    ASSERT_TRUE(dst.contains(item.key())) << "no parameter " << item.key() << " in the reference";
    dst[item.key()].copy_(item.value());
  }
}

// Single-process reference: `steps` steps on the whole global batch.
inline Params train_reference(torch::nn::Module& model, const std::function<torch::Tensor(torch::Tensor)>& forward,
                              Opt opt, int64_t steps = kSteps) {
  auto optim = make_optimizer(opt, model.parameters());
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step);
    optim->zero_grad();
    torch::mse_loss(forward(x), y).backward();
    optim->step();
  }
  return snapshot(model);
}

struct FsdpRun {
  Params params;                  // full parameters after training (gathered)
  int64_t forward_all_gathers = 0;  // shard-group all-gathers issued by one forward (the last step's)
  int64_t reduce_scatters = 0;      // and by its backward
};

// The FSDP side: each rank trains on its slice of the same global batches, then the full parameters are
// gathered on every rank. `forward` must invoke the root with fsdp::nn::call.
inline FsdpRun train_fsdp(torch::nn::Module& model, const std::function<torch::Tensor(torch::Tensor)>& forward,
                          Opt opt, int64_t steps = kSteps) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  EXPECT_EQ(kGlobalBatch % n, 0);
  const int64_t local = kGlobalBatch / n;
  auto optim = make_optimizer(opt, model.parameters());  // on the shards
  auto group = world_mesh().group(0);
  FsdpRun run;
  for (int64_t step = 0; step < steps; ++step) {
    auto [gx, gy] = global_batch(step);
    optim->zero_grad();
    fsdp::reset_comm_stats(*group);
    auto out = forward(gx.narrow(0, rank * local, local));
    run.forward_all_gathers = fsdp::comm_stats(*group).all_gather_calls;
    torch::mse_loss(out, gy.narrow(0, rank * local, local)).backward();
    run.reduce_scatters = fsdp::comm_stats(*group).reduce_scatter_calls;
    optim->step();
  }
  run.params = fsdp::full_state_dict(model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  return run;
}

inline double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(denom, 1e-12);
}

// Same names, same shapes, max relative difference <= 1e-5 per parameter; and the reference moved away from
// `init` (parity with an untrained model would be vacuous).
inline void expect_parity(const Params& got, const Params& ref, const Params& init) {
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0, moved = 0;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << "missing parameter " << name;
    ASSERT_EQ(got.at(name).sizes(), r.sizes()) << name;
    const double d = max_rel_diff(got.at(name), r);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-5) << name;
    ASSERT_TRUE(init.count(name)) << name;
    moved = std::max(moved, max_rel_diff(r, init.at(name)));
  }
  EXPECT_GT(moved, 1e-2) << "the reference did not train";
  std::cout << "[parity] " << ref.size() << " parameters, worst relative difference " << worst
            << ", training moved them by up to " << moved << "\n";
}

}  // namespace nn_test
