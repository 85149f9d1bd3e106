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

}  // namespace fsdp_device
