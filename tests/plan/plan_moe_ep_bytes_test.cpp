// fsdp-plan's expert-parallel all-to-all bytes against a real training step on 4 ranks: qwen3 cpu_tiny_moe with
// its experts split over ep = 2 or 4 ranks (fsdp::apply_expert_parallel, no FSDP: only the ep group's traffic
// is looked at), one forward and backward on a different batch per rank, the ep group's CommStats read after.
//   calls                  == 5 per MoE layer (count exchange, dispatch, combine; dispatch and combine again
//                             in backward), exactly as planned
//   bytes sent             == the byte model with this step's real routing, exactly: per MoE layer the counts
//                             (ep-1) E/ep int64, and 2 x (rows this rank sent + rows it received) x D x 4 (the
//                             forward's dispatch and combine, and their gradients going back)
//   mean over the ep ranks == the plan's uniform-routing estimate (T k (ep-1)/ep rows each way), within 10%
#include "plan.h"

#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/expert_parallel.h>
#include <fsdp/models/qwen3.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

using namespace fsdp::plan;
namespace llama = fsdp::models::llama;

namespace {

constexpr int64_t kBatch = 2, kSeq = 64;

void check(int64_t ep) {
  auto world = fsdp::world();
  ASSERT_EQ(world->size(), 4) << "written for 4 ranks";
  const llama::LlamaArgs args = llama::qwen3_flavor("cpu_tiny_moe");
  const auto o = args.moe_options();
  const int64_t E = o.num_experts, L = args.n_layers, D = args.dim, local = E / ep;
  llama::Transformer model(args);
  model->init_weights(0);  // the same weights on every rank
  model->train();
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {world->size() / ep, ep}, {"efsdp", "ep"});
  const fsdp::DeviceMesh ep_mesh = mesh["ep"];
  const fsdp::ProcessGroupPtr group = ep_mesh.group(0);
  for (auto& block : model->blocks()) {
    ASSERT_TRUE(block->moe);
    fsdp::apply_expert_parallel(block->moe->experts.ptr(), ep_mesh);
  }
  fsdp::reset_comm_stats(*group);
  at::Generator gen = at::detail::createCPUGenerator(100 + world->rank());
  const at::Tensor tokens = at::randint(args.vocab_size, {kBatch, kSeq}, gen, at::TensorOptions().dtype(at::kLong));
  model->forward(tokens).sum().backward();
  const fsdp::CommStats stats = fsdp::comm_stats(*group);  // a copy, before the check's own collectives

  // This step's routing: each rank's token counts per expert and layer, gathered over the ep group.
  at::Tensor mine = at::empty({L, E});
  for (int64_t l = 0; l < L; ++l) mine[l].copy_(model->blocks()[static_cast<size_t>(l)]->moe->tokens_per_expert());
  at::Tensor all = at::empty({ep, L, E});
  group->all_gather_into_tensor(all, mine.contiguous()).wait();
  const int64_t r = group->rank();
  int64_t expected = 0, rows_sent = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor counts = all.select(1, l).to(at::kLong);  // [ep, E]
    const int64_t sent = counts[r].sum().item<int64_t>() - counts[r].slice(0, r * local, (r + 1) * local).sum().item<int64_t>();
    const int64_t received =
        counts.slice(1, r * local, (r + 1) * local).sum().item<int64_t>() - counts[r].slice(0, r * local, (r + 1) * local).sum().item<int64_t>();
    expected += (ep - 1) * local * 8 + 2 * (sent + received) * D * 4;
    rows_sent += sent;
  }
  EXPECT_GT(rows_sent, 0);  // tokens did leave the rank
  EXPECT_EQ(stats.all_to_all_calls, 5 * L);
  EXPECT_EQ(stats.bytes_sent, expected);

  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_tiny_moe";
  c.args = args;
  c.shard = world->size();
  c.ep = ep;
  c.local_batch = kBatch;
  c.seq_len = kSeq;
  const Plan p = make_plan(c);
  EXPECT_EQ(p.comm.ep_all_to_all_calls, stats.all_to_all_calls);
  at::Tensor measured = at::full({1}, static_cast<double>(stats.bytes_sent), at::TensorOptions().dtype(at::kDouble));
  group->all_reduce(measured).wait();
  const double mean = measured.item<double>() / static_cast<double>(ep);
  const double planned = static_cast<double>(p.comm.ep_total_bytes);
  if (world->rank() == 0) {
    std::printf("[plan-moe-ep] ep %lld: this rank sent %lld bytes in %lld all-to-alls (byte model with the real "
                "routing: %lld); mean over the ep group %.0f, planned (uniform routing) %.0f (%+.1f%%)\n",
                static_cast<long long>(ep), static_cast<long long>(stats.bytes_sent),
                static_cast<long long>(stats.all_to_all_calls), static_cast<long long>(expected), mean, planned,
                100 * (planned / mean - 1));
  }
  EXPECT_NEAR(planned / mean, 1.0, 0.10);
}

}  // namespace

TEST(PlanMoEEpBytes, Ep2) { check(2); }
TEST(PlanMoEEpBytes, Ep4) { check(4); }
