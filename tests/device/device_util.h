#pragma once
// Shared pieces of the device tests (one GPU). Every test starts with FSDP_REQUIRE_CUDA(): without a CUDA
// device it GTEST_SKIP()s, and tests/device/CMakeLists.txt makes ctest report such a run as skipped, not
// passed. The world is joined by the test itself (DeviceWorld below), not by tests/comm/dist_env.h, because
// each executable picks its own backend and device, and a process without CUDA must not join at all.

#include "fully_shard/mlp_model.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#define FSDP_REQUIRE_CUDA()                                                                              \
  do {                                                                                                   \
    if (!torch::cuda::is_available())                                                                    \
      GTEST_SKIP() << "no CUDA device in this process: device test not run (scripts/gpu-check.sh runs it " \
                      "on a GPU machine)";                                                               \
  } while (0)

namespace fsdp_device {

// Joins the world (RANK etc. from fsdprun, or a 1-rank world when started by hand) on first use; left by
// ~DeviceWorld after a final barrier, so rank 0 (the TCPStore server) does not leave while others talk to it.
class DeviceWorld {
 public:
  DeviceWorld(const std::string& backend, const std::string& device) {
    fsdp::InitOptions o;
    o.backend = backend;
    o.device = device;
    o.timeout = std::chrono::seconds(120);
    if (std::getenv("RANK") == nullptr) {
      o.rank = 0;
      o.world_size = 1;
    }
    world_ = fsdp::init_process_group(o);
  }
  ~DeviceWorld() {
    try {
      world_->barrier().wait();
    } catch (const std::exception& e) {
      std::cerr << "final barrier failed: " << e.what() << "\n";
    }
    fsdp::destroy_process_group();
  }
  DeviceWorld(const DeviceWorld&) = delete;
  DeviceWorld& operator=(const DeviceWorld&) = delete;
  const fsdp::ProcessGroupPtr& group() const { return world_; }

 private:
  fsdp::ProcessGroupPtr world_;
};

// The parity model: tests/fully_shard/mlp_model.h (fsdp_test::MLP).
using fsdp_test::Block;
using fsdp_test::BlockImpl;
using fsdp_test::MLP;
using fsdp_test::MLPImpl;
using fsdp_test::make_mlp;

// make_mlp(seed) builds MLP(7, 19, 13, 5, 3) on the CPU (the same values on every rank and in the reference);
// the caller moves it to the device.
constexpr int64_t kIn = 7, kOut = 5;

// Deterministic global batch for `step`, built on the CPU by every rank, then moved to `device`.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t batch, const torch::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({batch, kIn}, gen);
  auto y = torch::randn({batch, kOut}, gen);
  return {x.to(device), y.to(device)};
}

inline double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(denom, 1e-12);
}

// One data-parallel step of an FSDP model: this rank's slice of the global batch, forward, backward (the
// optimizer step is the caller's, after its checks on the gradients).
inline void fsdp_backward_step(MLP& model, torch::optim::Optimizer& optim, int64_t step, int64_t global_batch_size,
                               int64_t rank, int64_t n, const torch::Device& device) {
  const int64_t local = global_batch_size / n;
  auto [gx, gy] = global_batch(step, global_batch_size, device);
  optim.zero_grad();
  torch::mse_loss(fsdp::nn::call(model, gx.narrow(0, rank * local, local)), gy.narrow(0, rank * local, local))
      .backward();
}

// Plain libtorch on `device`, the whole global batch each step (SGD 0.05, momentum 0.9): the parity reference
// of the Gloo-on-CUDA tests. Shares no code with fully_shard. Parameters by FQN, on the CPU.
inline std::map<std::string, torch::Tensor> train_reference(const torch::Device& device, int64_t steps,
                                                            int64_t global_batch_size) {
  MLP model = make_mlp(42);
  model->to(device);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step, global_batch_size, device);
    optim.zero_grad();
    torch::mse_loss(model(x), y).backward();
    optim.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().cpu();
  return out;
}

// Every parameter of `got` within `tolerance` (max relative difference) of `ref`; the reference must have moved
// away from make_mlp(42) (parity with an untrained model would be vacuous). Returns {worst, moved}.
inline std::pair<double, double> expect_parity(const std::map<std::string, torch::Tensor>& ref,
                                               const std::map<std::string, torch::Tensor>& got, double tolerance) {
  EXPECT_EQ(ref.size(), got.size());
  EXPECT_GE(ref.size(), 10u);
  double worst = 0;
  for (const auto& [name, r] : ref) {
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << "missing parameter " << name;
      continue;
    }
    const torch::Tensor g = it->second.cpu();
    if (g.sizes() != r.sizes()) {
      ADD_FAILURE() << name << ": shape " << g.sizes() << ", expected " << r.sizes();
      continue;
    }
    const double d = max_rel_diff(g, r);
    worst = std::max(worst, d);
    EXPECT_LE(d, tolerance) << name;
  }
  auto init = make_mlp(42);
  double moved = 0;
  for (const auto& item : init->named_parameters()) moved = std::max(moved, max_rel_diff(ref.at(item.key()), item.value()));
  EXPECT_GT(moved, 1e-2) << "training did not move the parameters: the comparison would be vacuous";
  return {worst, moved};
}

}  // namespace fsdp_device
