// fsdp::replicate (DDP in FSDP2's style) against single-process training on the same global batch: every rank
// trains on its rows of each global batch, and after every step each rank's own parameters — whole, never
// sharded — equal the reference's (1e-6). The ranks start from different initializations (each its own seed),
// so the parity also shows replicate's broadcast from replica 0; the gradients are counted as all-reduced.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/comm_stats.h>
#include <fsdp/replicate.h>

using namespace fsdp_test;

namespace {

constexpr int64_t kIn = 7, kOut = 5, kGlobalBatch = 24, kSteps = 5;
constexpr uint64_t kSeed = 42;

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

std::map<std::string, torch::Tensor> params_of(torch::nn::Module& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// The whole global batch on one process, `micro_batches` accumulated per step.
std::map<std::string, torch::Tensor> train_reference(int micro_batches) {
  MLP model = make_mlp(kSeed);
  auto optim = make_sgd(model->parameters());
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim->zero_grad();
    const int64_t mb = kGlobalBatch / micro_batches;
    for (int m = 0; m < micro_batches; ++m)
      (torch::mse_loss(model(x.narrow(0, m * mb, mb)), y.narrow(0, m * mb, mb)) / micro_batches).backward();
    optim->step();
  }
  return params_of(*model);
}

void expect_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& ref,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name << " missing";
    const auto& g = got.at(name);
    // Not sharded: this rank holds the whole parameter.
    ASSERT_EQ(g.sizes(), r.sizes()) << what << ": " << name << " is not whole on rank " << test_world()->rank();
    EXPECT_LE(max_rel_diff(g, r), 1e-6) << what << ": " << name;
  }
}

struct ReplicateRun {
  std::map<std::string, torch::Tensor> params;  // this rank's own parameters after training (no gathering)
  int64_t all_reduces = 0;                      // on the replicate group
};

// Every block, then the root (bottom-up); `mesh` invalid = replicate's default (the world).
ReplicateRun train_replicated(const fsdp::DeviceMesh& mesh, int micro_batches, fsdp::ProcessGroupPtr replicas) {
  auto world = test_world();
  const int64_t rank = world->rank(), n = world->size();
  // A different initialization on every rank: replicate must make rank 0's everyone's.
  MLP model = make_mlp(kSeed + static_cast<uint64_t>(rank));
  fsdp::ReplicateOptions opts;
  opts.mesh = mesh;
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::replicate(model->blocks[i], opts));
  units.push_back(fsdp::replicate(model, opts));
  fsdp::FSDPModule root = units.back();
  auto optim = make_sgd(model->parameters());
  ReplicateRun run;
  const int64_t ar_before = replicas ? fsdp::comm_stats(*replicas).all_reduce_calls : 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [gx, gy] = global_batch(step, kGlobalBatch, kIn, kOut);
    optim->zero_grad();
    const int64_t mb = kGlobalBatch / micro_batches, local_mb = mb / n;
    for (int m = 0; m < micro_batches; ++m) {
      root.set_requires_gradient_sync(m == micro_batches - 1);  // no_sync for all but the last micro-batch
      auto x = gx.narrow(0, m * mb + rank * local_mb, local_mb);
      auto y = gy.narrow(0, m * mb + rank * local_mb, local_mb);
      (torch::mse_loss(fsdp::nn::call(model, x), y) / micro_batches).backward();
    }
    optim->step();
  }
  run.all_reduces = replicas ? fsdp::comm_stats(*replicas).all_reduce_calls - ar_before : 0;
  run.params = params_of(*model);
  return run;
}

int64_t nranks() { return test_world()->size(); }

}  // namespace

TEST(Replicate, MatchesSingleProcessOnTheGlobalBatch) {
  const auto ref = train_reference(1);
  // The reference moved: training did something to compare.
  const auto init = params_of(*make_mlp(kSeed));
  EXPECT_GT(max_rel_diff(ref.at("output.weight"), init.at("output.weight")), 1e-3);
  auto mesh = fsdp::init_device_mesh("cpu", {nranks(), 1}, {"replicate", "shard"});
  ReplicateRun run = train_replicated(mesh, 1, mesh.group(0));
  expect_equal(run.params, ref, "replicate over a (replicate, shard=1) mesh");
  // One gradient all-reduce per replicated module (3 blocks + root) per step.
  EXPECT_EQ(run.all_reduces, nranks() > 1 ? 4 * kSteps : 0);
}

TEST(Replicate, DefaultMeshAndOneDimensionalMeshAreTheWorld) {
  const auto ref = train_reference(1);
  expect_equal(train_replicated({}, 1, nullptr).params, ref, "replicate on the default mesh");
  auto mesh = fsdp::init_device_mesh("cpu", {nranks()}, {"dp"});
  expect_equal(train_replicated(mesh, 1, nullptr).params, ref, "replicate on a 1-D mesh");
}

TEST(Replicate, NoSyncAccumulatesAndAllReducesOnceAStep) {
  const auto ref = train_reference(3);
  auto mesh = fsdp::init_device_mesh("cpu", {nranks(), 1}, {"replicate", "shard"});
  ReplicateRun run = train_replicated(mesh, 3, mesh.group(0));
  expect_equal(run.params, ref, "replicate with 3 micro-batches, the first two without gradient sync");
  // Only the last micro-batch of each step all-reduces: the same count as without accumulation.
  EXPECT_EQ(run.all_reduces, nranks() > 1 ? 4 * kSteps : 0);
}

TEST(Replicate, RejectsShardedMeshesAndSecondCalls) {
  MLP model = make_mlp(kSeed);
  if (nranks() % 2 == 0) {
    auto hsdp = fsdp::init_device_mesh("cpu", {nranks() / 2, 2}, {"replicate", "shard"});
    fsdp::ReplicateOptions opts;
    opts.mesh = hsdp;
    try {
      fsdp::replicate(model, opts);
      ADD_FAILURE() << "a mesh with shard size 2 was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("shard dim of size 1"), std::string::npos) << e.what();
    }
  }
  fsdp::replicate(model);
  try {
    fsdp::replicate(model);
    ADD_FAILURE() << "replicate twice was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already under fully_shard or replicate"), std::string::npos) << e.what();
  }
}
