// Expert parallelism (fsdp/expert_parallel.h) against the single-process MoE block on the global batch.
//
// Every rank builds the same block (same seed) twice: a reference that runs the whole global batch alone, and
// the one under test, whose experts are split over the ranks (ExpertParallel) and, in the FSDP cases, sharded
// over the data-parallel ranks left after ep (per-parameter meshes: experts on the efsdp mesh with Shard(0) or
// Shard(1), the router and shared experts over the whole world). Each rank feeds its slice of the batch; one
// SGD step later the output rows, the loss, every parameter (gathered) and the token counts must equal the
// reference's (1e-5), and the all-to-all bytes must equal the count derived from the reference's routing. The
// routing cases include a bias that sends no token to some experts, and one that leaves a whole ep rank
// without tokens.
#include "comm/dist_env.h"
#include "expect_error.h"

#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/moe.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/state_dict.h>
#include <fsdp/tensor_parallel.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace {

namespace moe = fsdp::models::moe;

constexpr int64_t kDim = 16, kHidden = 8, kSeq = 6, kBatchPerRank = 2;
constexpr double kLr = 0.5;

enum class Steer { None, SkipSomeExperts, StarveLastEpRank };

struct Case {
  int64_t num_experts = 8;
  int64_t ep = 0;  // 0 = world
  std::string score_func = "softmax";
  int64_t shared = 0;
  Steer steer = Steer::None;
  bool fsdp = false;
  bool route_norm = true;
};

moe::MoEOptions options_of(const Case& c) {
  moe::MoEOptions o;
  o.dim = kDim;
  o.hidden = kHidden;
  o.num_experts = c.num_experts;
  o.top_k = 2;
  o.score_func = c.score_func;
  o.route_norm = c.route_norm;
  o.num_shared_experts = c.shared;
  return o;
}

moe::MoE build(const Case& c) {
  moe::MoE block(options_of(c));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  block->init_weights(gen, 0.3);
  torch::NoGradGuard no_grad;
  const int64_t E = c.num_experts;
  if (c.steer == Steer::SkipSomeExperts) {
    // Experts 1 and E-2 are never chosen: they get no tokens anywhere.
    block->expert_bias[1] = -10.0;
    block->expert_bias[E - 2] = -10.0;
  } else if (c.steer == Steer::StarveLastEpRank) {
    // Only the first two experts are chosen (top-2): the ep ranks holding none of them receive no rows.
    block->expert_bias.slice(0, 0, 2).fill_(10.0);
  }
  return block;
}

// The global batch and the loss weights, identical on every rank.
std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  auto x = torch::randn({world * kBatchPerRank, kSeq, kDim}, gen);
  auto g = torch::randn({world * kBatchPerRank, kSeq, kDim}, gen);
  return {x, g};
}

// The global loss is the mean over the ranks of each rank's mean of (out * g) over its rows: each rank
// backpropagates its own term and FSDP (or the test, without it) averages.
torch::Tensor local_loss(const torch::Tensor& out, const torch::Tensor& g) { return (out * g).sum(-1).mean(); }

struct Traffic {
  int64_t rows_sent = 0, rows_received = 0;
};

// What this rank's expert-parallel forward must send and receive, from the reference's routing of every slice.
Traffic expected_traffic(moe::MoE& ref, const torch::Tensor& x, int64_t world, int64_t ep, int64_t rank) {
  const int64_t E = ref->options().num_experts, per = E / ep;
  const int64_t ep_rank = rank % ep, group_start = rank - ep_rank;
  Traffic t;
  torch::NoGradGuard no_grad;
  for (int64_t src = group_start; src < group_start + ep; ++src) {
    auto xs = x.slice(0, src * kBatchPerRank, (src + 1) * kBatchPerRank).reshape({-1, kDim});
    auto ids = ref->router->forward(xs, ref->expert_bias).expert_ids.reshape({-1});
    auto counts = torch::bincount(ids, {}, E);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t owner = e / per, n = counts[e].item<int64_t>();
      if (src == rank && owner != ep_rank) t.rows_sent += n;
      if (src != rank && owner == ep_rank) t.rows_received += n;
    }
  }
  return t;
}

void run_case(const Case& c) {
  auto world = fsdp_test::test_world();
  const int64_t W = world->size(), rank = world->rank();
  const int64_t ep = c.ep == 0 ? W : c.ep;
  ASSERT_EQ(W % ep, 0);
  ASSERT_EQ(c.num_experts % ep, 0);
  const auto [x, g] = global_batch(W);

  // Reference: the whole batch in one process.
  moe::MoE ref = build(c);
  ref->train();
  auto ref_out = ref->forward(x);
  torch::Tensor ref_loss = torch::zeros({});
  for (int64_t r = 0; r < W; ++r) {
    auto sl = torch::indexing::Slice(r * kBatchPerRank, (r + 1) * kBatchPerRank);
    ref_loss = ref_loss + local_loss(ref_out.index({sl}), g.index({sl})) / static_cast<double>(W);
  }
  ref_loss.backward();
  const auto ref_counts = ref->tokens_per_expert().clone();
  const Traffic t = expected_traffic(ref, x, W, ep, rank);  // before the step changes the router
  ASSERT_GT(ref_counts.sum().item<double>(), 0);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ref->parameters()) p.sub_(kLr * p.grad());
  }

  // Under test.
  moe::MoE block = build(c);
  block->train();
  const fsdp::DeviceMesh sparse = fsdp::init_device_mesh("cpu", {W / ep, ep}, {"efsdp", "ep"});
  fsdp::parallelize_module(block->experts, sparse["ep"], {{"", fsdp::ExpertParallel{}}});
  ASSERT_TRUE(fsdp::is_expert_parallel(*block->experts));
  EXPECT_EQ(block->experts->w1.size(0), c.num_experts / ep) << "each ep rank keeps its experts only";
  fsdp::FSDPModule sharded;
  if (c.fsdp) {
    fsdp::FullyShardOptions o;
    o.mesh = fsdp::init_device_mesh("cpu", {W}, {"dp_shard"});
    const fsdp::DeviceMesh efsdp = sparse["efsdp"];
    // TorchTitan's rule: Shard(1) when the expert weights would be cut in more shards than there are experts.
    const int64_t expert_dim = W > c.num_experts ? 1 : 0;
    const auto* w1 = block->experts->w1.unsafeGetTensorImpl();
    const auto* w2 = block->experts->w2.unsafeGetTensorImpl();
    const auto* w3 = block->experts->w3.unsafeGetTensorImpl();
    o.shard_placement_fn = [=](const at::Tensor& p) -> std::optional<fsdp::ShardPlacement> {
      const auto* impl = p.unsafeGetTensorImpl();
      if (impl == w1 || impl == w2 || impl == w3) return fsdp::ShardPlacement{expert_dim, efsdp};
      return std::nullopt;
    };
    sharded = fsdp::fully_shard(block, o);
    // An expert's gradient already sums the tokens of its ep peers: divide by the data-parallel size, not the
    // efsdp size (TorchTitan tt#1551).
    sharded.set_gradient_divide_factor(static_cast<double>(W));
    // The experts' global layout over (efsdp, ep): FSDP's dim inside the ep split.
    const auto placements = fsdp::sharded_state_dict(*block).at("experts.w1").placements();
    const std::string want = expert_dim == 1 ? "(Shard(1), Shard(0))" : "(_StridedShard(dim=0, sf=" + std::to_string(ep) + "), Shard(0))";
    EXPECT_EQ(fsdp::to_string(placements), want);
  }
  auto ep_group = sparse.group("ep");
  fsdp::reset_comm_stats(*ep_group);
  auto sl = torch::indexing::Slice(rank * kBatchPerRank, (rank + 1) * kBatchPerRank);
  // The input needs a gradient, as a block's input does inside a model: backward then exchanges rows too.
  auto out = fsdp::nn::call(block, x.index({sl}).clone().requires_grad_());
  auto loss = local_loss(out, g.index({sl}));
  (c.fsdp ? loss : loss / static_cast<double>(W)).backward();
  EXPECT_TRUE(torch::allclose(out, ref_out.index({sl}), 1e-5, 1e-5))
      << "rank " << rank << " max diff " << (out - ref_out.index({sl})).abs().max().item<double>();

  // All-to-all bytes: the count exchange, then dispatch and combine in forward and again in backward.
  const int64_t row_bytes = kDim * 4;
  const int64_t expected_bytes = (ep - 1) * (c.num_experts / ep) * 8 + 2 * (t.rows_sent + t.rows_received) * row_bytes;
  EXPECT_EQ(fsdp::comm_stats(*ep_group).all_to_all_calls, 5);
  EXPECT_EQ(fsdp::comm_stats(*ep_group).bytes_sent, expected_bytes) << "rank " << rank;
  if (c.steer == Steer::StarveLastEpRank && ep > 1 && rank % ep == ep - 1) EXPECT_EQ(t.rows_received, 0);

  // Counts: each rank counted its own tokens; their sum is the reference's.
  auto counts = block->tokens_per_expert().clone();
  world->all_reduce(counts, fsdp::ReduceOp::Sum).wait();
  EXPECT_TRUE(torch::equal(counts, ref_counts)) << counts << ref_counts;
  if (c.steer == Steer::SkipSomeExperts) {
    EXPECT_EQ(ref_counts[1].item<double>(), 0.0);
    EXPECT_EQ(ref_counts[c.num_experts - 2].item<double>(), 0.0);
  }

  // One SGD step. Without FSDP the dense gradients are averaged here (each rank holds its own term); expert
  // gradients already hold every ep peer's tokens.
  {
    torch::NoGradGuard no_grad;
    for (auto& item : block->named_parameters()) {
      auto& p = item.value();
      if (!c.fsdp && item.key().rfind("experts.", 0) != 0) {
        world->all_reduce(p.mutable_grad(), fsdp::ReduceOp::Sum).wait();
      }
      p.sub_(kLr * p.grad());
    }
  }
  // Gathered by the state dict under FSDP; without it, each rank compares its own experts' rows.
  fsdp::FullStateDict full;
  if (c.fsdp) {
    full = fsdp::full_state_dict(*block, {/*cpu_offload=*/true, /*rank0_only=*/false});
  } else {
    for (const auto& item : block->named_parameters()) full[item.key()] = item.value().detach();
  }
  const int64_t local_experts = c.num_experts / ep, ep_rank = rank % ep;
  int64_t moved = 0;
  for (const auto& item : ref->named_parameters()) {
    ASSERT_TRUE(full.count(item.key())) << item.key();
    const auto& got = full.at(item.key());
    auto want = item.value().detach();
    if (!c.fsdp && item.key().rfind("experts.", 0) == 0) want = want.slice(0, ep_rank * local_experts, (ep_rank + 1) * local_experts);
    ASSERT_EQ(got.sizes(), want.sizes()) << item.key();
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5))
        << item.key() << " max diff " << (got - want).abs().max().item<double>();
    moved += item.value().grad().abs().sum().item<double>() > 0;
  }
  EXPECT_GE(moved, 4) << "the reference step moved the parameters";
}

TEST(ExpertParallel, EqualsOneProcessSoftmaxNoFSDP) { run_case({}); }

TEST(ExpertParallel, EqualsOneProcessSigmoidSharedExpert) {
  Case c;
  c.score_func = "sigmoid";
  c.route_norm = false;
  c.shared = 1;
  run_case(c);
}

TEST(ExpertParallel, ExpertsWithoutTokens) {
  Case c;
  c.steer = Steer::SkipSomeExperts;
  run_case(c);
}

TEST(ExpertParallel, AnEpRankWithoutTokens) {
  Case c;
  c.steer = Steer::StarveLastEpRank;
  c.fsdp = true;
  run_case(c);
}

TEST(ExpertParallel, WithFullyShardOverTheRanksLeftAfterEp) {
  auto world = fsdp_test::test_world();
  Case c;
  c.fsdp = true;
  c.shared = 1;
  c.ep = world->size() >= 4 ? 2 : world->size();  // 4 ranks: ep 2 x efsdp 2
  run_case(c);
}

TEST(ExpertParallel, ShardOneWhenFewerExpertsThanShards) {
  auto world = fsdp_test::test_world();
  if (world->size() < 4) GTEST_SKIP() << "needs 4 ranks (2 experts, ep 2 x efsdp 2)";
  Case c;
  c.num_experts = 2;
  c.ep = 2;
  c.fsdp = true;
  run_case(c);
}

TEST(ExpertParallel, BadUsesAreRefused) {
  auto world = fsdp_test::test_world();
  const auto expect_error = fsdp_test::expect_error_containing<c10::Error>;
  if (world->size() >= 2) {
    Case c;
    c.num_experts = world->size() + 1;
    moe::MoE block = build(c);
    auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"ep"});
    expect_error([&] { fsdp::apply_expert_parallel(block->experts.ptr(), mesh); }, "do not divide");
  }
  moe::MoE block = build({});
  auto mesh2 = fsdp::init_device_mesh("cpu", {1, world->size()}, {"a", "ep"});
  expect_error([&] { fsdp::apply_expert_parallel(block->experts.ptr(), mesh2); }, "must be 1-D");
  expect_error([&] { fsdp::apply_expert_parallel(block.ptr(), mesh2["ep"]); }, "no parameters of its own");
}

}  // namespace
