// The world-size-1 fast path (issue 11): with one rank, no mixed precision and no offload, fully_shard copies
// nothing and communicates nothing — the unsharded parameter is the shard itself, the gradient autograd
// produced becomes the sharded .grad — and training is bit for bit the training of the plain model.
// With a cast (bf16 compute) the regular path runs and still trains.
#include "fully_shard/fsdp_test_util.h"
#include <fsdp/comm_stats.h>

#include "fully_shard/fsdp_state.h"

#include <torch/torch.h>

using namespace fsdp_test;

namespace {

fsdp::DeviceMesh mesh1() {
  static fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {test_world()->size()}, {"shard"});
  return mesh;
}

std::vector<fsdp::FSDPModule> shard(MLP& model, const fsdp::MixedPrecisionPolicy& mp = {}) {
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh1();
  opts.mp_policy = mp;
  return fsdp_test::shard_mlp(model, opts);
}

}  // namespace

// Unsharded parameters alias the shards (same data pointer, in forward and in backward), no collective is
// issued, and the .grad left after backward is the very tensor autograd accumulated (no clone).
TEST(World1FastPath, NoCopiesNoCollectives) {
  if (test_world()->size() != 1) GTEST_SKIP() << "world-size-1 test";
  MLP model = make_mlp(3);
  std::map<std::string, const void*> shard_ptr;
  for (const auto& item : model->named_parameters()) shard_ptr[item.key()] = nullptr;
  auto units = shard(model);
  for (const auto& item : model->named_parameters()) shard_ptr[item.key()] = item.value().data_ptr();

  // Inside a block's forward its parameters show the full tensors: the same memory as the shards.
  int checked_forward = 0;
  fsdp::nn::register_forward_pre_hook(*model->blocks[1], [&](torch::nn::Module& m, fsdp::nn::TensorList&) {
    for (const auto& item : m.named_parameters()) {
      EXPECT_EQ(item.value().data_ptr(), shard_ptr.at("blocks.1." + item.key())) << item.key();
      ++checked_forward;
    }
  });
  // The gradient autograd hands to the accumulator of each parameter (captured by a hook): after backward the
  // sharded .grad must be that same memory.
  std::map<std::string, const void*> produced;
  for (const auto& item : model->named_parameters()) {
    const std::string name = item.key();
    item.value().register_hook([&produced, name](const torch::Tensor& g) { produced[name] = g.data_ptr(); });
  }
  auto group = mesh1().group(0);
  fsdp::reset_comm_stats(*group);
  auto x = torch::randn({4, 7});
  fsdp::nn::call(model, x).sum().backward();
  EXPECT_EQ(checked_forward, 4);
  const auto& s = fsdp::comm_stats(*group);
  EXPECT_EQ(s.all_gather_calls, 0);
  EXPECT_EQ(s.reduce_scatter_calls, 0);
  EXPECT_EQ(s.all_reduce_calls, 0);
  EXPECT_EQ(s.bytes_sent, 0);
  for (const auto& item : model->named_parameters()) {
    EXPECT_EQ(item.value().data_ptr(), shard_ptr.at(item.key())) << item.key() << ": shard moved";
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    ASSERT_TRUE(produced.count(item.key())) << item.key();
    EXPECT_EQ(item.value().grad().data_ptr(), produced.at(item.key())) << item.key() << ": gradient was copied";
  }
  for (const auto& u : units) {
    auto* g = fsdp::detail::FSDPModuleAccess::state(u).param_group();
    EXPECT_TRUE(g->unshards_locally());
    EXPECT_TRUE(g->hands_over_gradients());
    EXPECT_FALSE(g->is_unsharded());
  }
}

// Training with fully_shard at world size 1 equals training the same model without it, bit for bit: AdamW,
// several steps, gradient accumulation over two backwards in one step, zero_grad to None.
TEST(World1FastPath, TrainingEqualsPlainTrainingBitForBit) {
  if (test_world()->size() != 1) GTEST_SKIP() << "world-size-1 test";
  MLP reference = make_mlp(11, 4);
  MLP model = make_mlp(11, 4);
  auto units = shard(model);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < 6; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      auto [x, y] = global_batch(10 * step + micro, 8, 7, 5);
      torch::mse_loss(reference->forward(x), y).backward();
      torch::mse_loss(fsdp::nn::call(model, x), y).backward();
    }
    ref_opt.step();
    opt.step();
  }
  auto ref = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), ref[item.key()])) << item.key() << " differs by "
                                                             << max_rel_diff(item.value(), ref[item.key()]);
  }
}

// A cast means copies: bf16 compute takes the regular path (gathers and reduce-scatters of size 1) and trains.
TEST(World1FastPath, MixedPrecisionTakesTheRegularPath) {
  if (test_world()->size() != 1) GTEST_SKIP() << "world-size-1 test";
  MLP model = make_mlp(5);
  fsdp::MixedPrecisionPolicy mp;
  mp.param_dtype = torch::kBFloat16;
  mp.reduce_dtype = torch::kFloat32;
  auto units = shard(model, mp);
  auto group = mesh1().group(0);
  fsdp::reset_comm_stats(*group);
  auto x = torch::randn({4, 7});
  fsdp::nn::call(model, x).sum().backward();
  EXPECT_GE(fsdp::comm_stats(*group).all_gather_calls, 4);  // every group in forward, resharded blocks again in backward
  EXPECT_EQ(fsdp::comm_stats(*group).reduce_scatter_calls, 4);
  for (const auto& u : units) {
    EXPECT_FALSE(fsdp::detail::FSDPModuleAccess::state(u).param_group()->unshards_locally());
  }
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat32) << item.key();
  }
}
