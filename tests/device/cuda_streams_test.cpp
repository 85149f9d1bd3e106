// Streams and events on a GPU (issue 11, "GPU readiness"; src/fully_shard/fsdp_streams.h): N ranks share
// cuda:0 over Gloo. The root's stream set has separate copy-in / all-gather / reduce-scatter / all-reduce
// streams, none of them the compute stream; events are recorded and waited on during training; no buffer is
// held across streams after a step; and training still equals single-process training — with parameters on
// the GPU, and with CPU offload (pinned shards, non-blocking copies both ways). Run on an H100 by
// scripts/gpu-check.sh (docs/comm.md); its first run found full_state_dict failing on CPU-offloaded shards of
// a CUDA mesh (fixed in ShardedTensor::redistribute: collectives on the group's device).
#include "device/device_util.h"

#include "fully_shard/fsdp_state.h"

#include <memory>

using namespace fsdp_device;

namespace {

constexpr int64_t kGlobalBatch = 24, kSteps = 6;

void train_and_compare(const fsdp::ProcessGroupPtr& world, bool cpu_offload) {
  const torch::Device device = world->device();
  ASSERT_TRUE(device.is_cuda()) << device;
  const int64_t rank = world->rank(), n = world->size();
  ASSERT_EQ(kGlobalBatch % n, 0);

  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cuda", {n}, {"shard"});
  opts.offload_policy.cpu_offload = cpu_offload;
  opts.offload_policy.pin_memory = true;
  MLP model = make_mlp(42);
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], opts));
  units.push_back(fsdp::fully_shard(model, opts));
  for (const auto& item : model->named_parameters()) {
    if (cpu_offload) {
      ASSERT_TRUE(item.value().is_cpu()) << item.key();
      EXPECT_TRUE(item.value().is_pinned()) << item.key() << ": offloaded shard not in pinned memory";
    } else {
      ASSERT_EQ(item.value().device(), device) << item.key();
    }
  }
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    fsdp_backward_step(model, optim, step, kGlobalBatch, rank, n, device);
    for (const auto& item : model->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      ASSERT_EQ(item.value().grad().device(), item.value().device()) << item.key();
    }
    optim.step();
  }

  // The streams were separate and used.
  auto& root = fsdp::detail::FSDPModuleAccess::state(units.back());
  ASSERT_TRUE(root.root_context() && root.root_context()->comm);
  const auto& comm = *root.root_context()->comm;
  const auto& s = comm.streams;
  ASSERT_TRUE(s.separate()) << "no separate streams on " << device;
  const c10::Stream compute = s.current();
  EXPECT_NE(s.all_gather_copy_in(), compute);
  EXPECT_NE(s.all_gather(), compute);
  EXPECT_NE(s.reduce_scatter(), compute);
  EXPECT_NE(s.all_reduce(), compute);
  EXPECT_NE(s.all_gather(), s.all_gather_copy_in());
  EXPECT_NE(s.all_gather(), s.reduce_scatter());
  if (n > 1) {
    // Per step, at least for one group: copy-in after compute, gather after copy-in, compute after gather,
    // reduce after compute, compute after the reduction.
    EXPECT_GE(s.events_recorded(), kSteps * 5) << "the all-gathers / reduce-scatters did not use the streams";
    EXPECT_GE(s.waits_issued(), s.events_recorded());
  }
  EXPECT_FALSE(comm.all_gather_state.holding()) << "an all-gather output outlived the forward";
  EXPECT_FALSE(comm.reduce_scatter_state.holding()) << "a reduce-scatter input outlived the backward";

  auto got = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
  // The same tolerance as gloo_cuda_parity_test (cuBLAS kernels differ per local batch shape); with offload
  // the optimizer runs on the CPU.
  const auto [worst, moved] = expect_parity(train_reference(device, kSteps, kGlobalBatch), got, 1e-4);
  std::cout << "[cuda streams" << (cpu_offload ? ", cpu offload" : "") << "] rank " << rank << " of " << n << ": "
            << s.events_recorded() << " events, " << s.waits_issued() << " waits, worst relative difference "
            << worst << ", training moved parameters by " << moved << "\n";
}

}  // namespace

// One test (one world per process): on the GPU, then with pinned CPU offload.
TEST(CudaStreams, SeparateStreamsAndParity) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("gloo", "cuda:0");
  train_and_compare(dw.group(), /*cpu_offload=*/false);
  train_and_compare(dw.group(), /*cpu_offload=*/true);
}
