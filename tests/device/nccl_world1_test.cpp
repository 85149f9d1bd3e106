// NCCL at world size 1 (issue 11, "GPU readiness"): init_process_group with backend "nccl", a "cuda" mesh,
// fully_shard on it, and training steps equal to plain training of the same model on the same GPU. At world
// size 1 the library takes its local fast path (no communicator is created, no NCCL kernel runs): this proves
// the NCCL-build wiring (backend choice, device, mesh, parameters on the GPU, the optimizer on the shards),
// not NCCL's collectives — those need two GPUs. Run on an H100 by scripts/gpu-check.sh (docs/comm.md).
#include "device/device_util.h"

using namespace fsdp_device;

TEST(NcclWorld1, FullyShardStepsEqualPlainTraining) {
  FSDP_REQUIRE_CUDA();
#ifndef FSDP_TEST_WITH_NCCL
  GTEST_SKIP() << "libfsdp was built without FSDP_WITH_NCCL: the NCCL device test is not run";
#endif
  DeviceWorld dw("nccl", "");  // "": NCCL's default device, cuda:LOCAL_RANK = cuda:0
  const auto& world = dw.group();
  ASSERT_EQ(world->backend(), "nccl");
  ASSERT_EQ(world->size(), 1);
  const torch::Device device = world->device();
  ASSERT_EQ(device, torch::Device(torch::kCUDA, 0));

  MLP ref = make_mlp(42);
  ref->to(device);
  MLP model = make_mlp(42);
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cuda", {1}, {"shard"});
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks[i], opts);
  fsdp::fully_shard(model, opts);
  for (const auto& item : model->named_parameters()) ASSERT_EQ(item.value().device(), device) << item.key();

  torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int64_t step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(step, 16, device);
    opt_ref.zero_grad();
    torch::mse_loss(ref(x), y).backward();
    opt_ref.step();
    opt.zero_grad();
    torch::mse_loss(fsdp::nn::call(model, x), y).backward();
    opt.step();
  }
  // The same kernels on the same shapes in the same order: equal bit for bit (the CPU world-1 test's claim).
  auto init = make_mlp(42);
  const auto ref_params = ref->named_parameters();
  const auto init_params = init->named_parameters();
  double moved = 0;
  int compared = 0;
  for (const auto& item : model->named_parameters()) {
    const torch::Tensor r = ref_params[item.key()].detach().cpu();
    const torch::Tensor g = item.value().detach().cpu();
    ASSERT_EQ(g.sizes(), r.sizes()) << item.key();
    EXPECT_TRUE(torch::equal(g, r)) << item.key() << ": max |difference| " << (g - r).abs().max().item<double>();
    moved = std::max(moved, max_rel_diff(r, init_params[item.key()]));
    ++compared;
  }
  EXPECT_GE(compared, 10);
  EXPECT_GT(moved, 1e-2) << "training did not move the parameters: the comparison would be vacuous";
  std::cout << "[nccl world 1] " << compared << " parameters equal after 5 AdamW steps on " << device
            << ", training moved them by " << moved << "\n";
}
