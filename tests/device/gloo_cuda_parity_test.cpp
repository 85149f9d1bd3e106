// Gloo on CUDA tensors (issue 11, "GPU readiness"): N ranks share the one GPU (every rank on cuda:0, the
// model's parameters, shards and gradients on it), and fully_shard training equals single-process training on
// the same global batch on that GPU. The reference is plain libtorch; it shares no code with fully_shard.
// Run on an H100 by scripts/gpu-check.sh (docs/comm.md records the runs).
#include "device/device_util.h"
#include <fsdp/comm_stats.h>

#include <memory>

using namespace fsdp_device;

namespace {

constexpr int64_t kGlobalBatch = 24, kSteps = 10;

}  // namespace

TEST(GlooCuda, FullyShardParityAllRanksOnOneGpu) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("gloo", "cuda:0");
  const auto& world = dw.group();
  const torch::Device device = world->device();
  ASSERT_EQ(world->backend(), "gloo");
  ASSERT_TRUE(device.is_cuda()) << device;
  const int64_t rank = world->rank(), n = world->size();
  ASSERT_EQ(kGlobalBatch % n, 0);

  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cuda", {n}, {"shard"});
  MLP model = make_mlp(42);  // on the CPU: fully_shard moves it to the mesh's device
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], opts));
  units.push_back(fsdp::fully_shard(model, opts));
  for (const auto& item : model->named_parameters()) {
    ASSERT_EQ(item.value().device(), device) << item.key() << " was not moved to the mesh's device";
  }
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  // fully_shard communicates on the mesh's own group (a new group per mesh dim), not on the world group.
  const fsdp::ProcessGroupPtr shard_group = opts.mesh.group(0);
  const int64_t called_before = fsdp::collectives_called(*shard_group);
  for (int64_t step = 0; step < kSteps; ++step) {
    fsdp_backward_step(model, optim, step, kGlobalBatch, rank, n, device);
    for (const auto& item : model->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key() << " has no gradient after step " << step;
      ASSERT_EQ(item.value().grad().device(), device) << item.key();
    }
    optim.step();
  }
  // Not vacuous: the steps communicated through Gloo (all-gathers and reduce-scatters on CUDA tensors).
  const int64_t called = fsdp::collectives_called(*shard_group) - called_before;
  if (n > 1) EXPECT_GE(called, 2 * kSteps) << "the training steps issued almost no collectives";

  auto got = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  // cuBLAS picks its kernels per shape (split-K sums in another order for the N-times-smaller local batch),
  // so fp32 parity is to 1e-4 here, not the CPU test's 1e-5.
  const auto [worst, moved] = expect_parity(train_reference(device, kSteps, kGlobalBatch), got, 1e-4);
  std::cout << "[gloo-cuda parity] rank " << rank << " of " << n << " on " << device << ": " << called
            << " collectives, worst relative difference " << worst << ", training moved parameters by " << moved
            << "\n";
}
