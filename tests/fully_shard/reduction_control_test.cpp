// Explicit reduction control for pipeline schedules (issue 24): set_is_last_backward, per-micro-batch
// set_requires_gradient_sync and FSDPModule::post_backward(). Over 4 micro-batches each group reduce-scatters
// exactly once per step (counted on the mesh's shard group), and training equals single-process training on
// the whole global batch (1e-5) — with the reduction in the last micro-batch's backward, or run explicitly
// after all of them. With parameters kept unsharded across micro-batches (TorchTitan's choice under PP), each
// group also all-gathers exactly once per step.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/comm_stats.h>

using namespace fsdp_test;

namespace {

constexpr int64_t kIn = 7, kOut = 5, kGlobalBatch = 48, kSteps = 4, kMicroBatches = 4;  // 12 rows per micro-batch: 1, 2, 4 ranks

std::map<std::string, torch::Tensor> train_reference() {
  MLP model = make_mlp(42);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim.zero_grad();
    torch::mse_loss(model(x), y).backward();  // one backward on the whole batch
    optim.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

enum class Reduce { InLastBackward, ExplicitPostBackward };

struct Counts {
  int64_t reduce_scatters = 0, all_gathers = 0;
};

std::map<std::string, torch::Tensor> train_fsdp(Reduce how, bool keep_unsharded, std::vector<Counts>& per_step,
                                                size_t& groups) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  MLP model = make_mlp(42);
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {n});
  if (keep_unsharded) opts.reshard_after_forward = false;
  auto units = shard_mlp(model, opts);
  groups = units.size();
  fsdp::FSDPModule root = units.back();
  if (keep_unsharded) root.set_reshard_after_backward(false);
  auto& group = *opts.mesh.group(0);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t mb = kGlobalBatch / kMicroBatches, local_mb = mb / n;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [gx, gy] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim.zero_grad();
    fsdp::reset_comm_stats(group);
    for (int m = 0; m < kMicroBatches; ++m) {
      const bool last = m == kMicroBatches - 1;
      // What a pipeline stage does before every micro-batch's backward (torch.distributed.pipelining).
      const bool sync = how == Reduce::InLastBackward && last;
      root.set_requires_gradient_sync(sync);
      root.set_is_last_backward(sync);
      if (keep_unsharded && sync) root.set_reshard_after_backward(true);
      auto x = gx.narrow(0, m * mb + rank * local_mb, local_mb);
      auto y = gy.narrow(0, m * mb + rank * local_mb, local_mb);
      (torch::mse_loss(fsdp::nn::call(model, x), y) / kMicroBatches).backward();
      if (!last) EXPECT_EQ(fsdp::comm_stats(group).reduce_scatter_calls, 0) << "micro-batch " << m;
    }
    if (how == Reduce::ExplicitPostBackward) {
      EXPECT_EQ(fsdp::comm_stats(group).reduce_scatter_calls, 0);
      root.set_requires_gradient_sync(true);
      root.set_is_last_backward(true);
      root.set_reshard_after_backward(true);
      root.post_backward();  // REDUCE_GRAD: one reduce-scatter per group, here
    }
    per_step.push_back({fsdp::comm_stats(group).reduce_scatter_calls, fsdp::comm_stats(group).all_gather_calls});
    if (keep_unsharded) root.set_reshard_after_backward(false);
    optim.step();
  }
  return full_params(*model, units);
}

void expect_parity(Reduce how, bool keep_unsharded) {
  auto world = test_world();
  const auto want = train_reference();
  const auto initial = initial_mlp_params(42);
  std::vector<Counts> per_step;
  size_t groups = 0;
  const auto got = train_fsdp(how, keep_unsharded, per_step, groups);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    EXPECT_GT((w - initial.at(name)).abs().max().item<double>(), 1e-4) << name << ": the reference did not move";
    EXPECT_LT(max_rel_diff(got.at(name), w), 1e-5) << name;
  }
  ASSERT_EQ(per_step.size(), static_cast<size_t>(kSteps));
  if (world->size() == 1) return;  // a world of one communicates nothing
  for (size_t s = 0; s < per_step.size(); ++s) {
    EXPECT_EQ(per_step[s].reduce_scatters, static_cast<int64_t>(groups)) << "step " << s;
    if (keep_unsharded) EXPECT_EQ(per_step[s].all_gathers, static_cast<int64_t>(groups)) << "step " << s;
  }
}

}  // namespace

TEST(FullyShardReductionControl, IsLastBackwardWithNoSyncReducesOncePerGroupPerStep) {
  expect_parity(Reduce::InLastBackward, /*keep_unsharded=*/false);
}

TEST(FullyShardReductionControl, ExplicitPostBackwardReducesOncePerGroupPerStep) {
  expect_parity(Reduce::ExplicitPostBackward, /*keep_unsharded=*/false);
}

TEST(FullyShardReductionControl, KeptUnshardedAcrossMicroBatchesGathersAndReducesOncePerGroupPerStep) {
  expect_parity(Reduce::ExplicitPostBackward, /*keep_unsharded=*/true);
  expect_parity(Reduce::InLastBackward, /*keep_unsharded=*/true);
}

TEST(FullyShardReductionControl, PostBackwardOutsideItsPlaceIsRefused) {
  auto world = test_world();
  MLP model = make_mlp(3);
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {world->size()});
  auto units = shard_mlp(model, opts);
  // Inside a module's forward: the group is in its forward phase.
  std::string error;
  fsdp::nn::register_forward_pre_hook(*model->blocks[1], [&](torch::nn::Module&, fsdp::nn::TensorList&) {
    try {
      units.back().post_backward();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  });
  fsdp::nn::call(model, torch::randn({2, 7})).sum().backward();
  EXPECT_NE(error.find("post_backward() on"), std::string::npos) << error;
  EXPECT_NE(error.find("is in forward"), std::string::npos) << error;
}
