// fsdp-plan's MoE memory against fsdp-train's measured tensor memory on 4 ranks: qwen3 cpu_small_moe (4 MoE
// blocks of 8 experts, top-2), FSDP over 4 ranks with ep 1 (experts in the blocks' groups) and ep 2 (experts
// split over rank pairs, their FSDP over the 2 ranks left), float32, one sample of 512 tokens per rank, the
// trainer's default reshard policy. metrics.tensor_memory (a counting allocator around libtorch's CPU
// allocator) gives the second step's live tensor bytes at its start, at the end of forward and at its peak;
// the plan's end_of_forward and step_peak are the same quantities above the persistent state. The batches are
// real text, so the routing is whatever the router does (the plan assumes uniform routing under EP).
#include "config.h"
#include "plan.h"
#include "trainer.h"
#include "trainer/train_env.h"

#include <fsdp/models/qwen3.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

using namespace fsdp_train;
using namespace fsdp::plan;

namespace {

constexpr int64_t kSeq = 512;

TrainSummary::TensorMemory measure(int64_t ep) {
  auto world = fsdp::world();
  JobConfig c = load_config({"--model.name", "qwen3", "--model.flavor", "cpu_small_moe", "--training.seq_len",
                             std::to_string(kSeq), "--training.local_batch_size", "1", "--training.global_batch_size",
                             std::to_string(world->size()), "--training.steps", "2", "--lr_scheduler.warmup_steps",
                             "1", "--metrics.peak_tflops", "1", "--metrics.tensor_memory", "true",
                             "--parallelism.expert_parallel_degree", std::to_string(ep)});
  c.job.dump_folder = test::shared_dir("fsdp_plan_moe", "ep" + std::to_string(ep));
  const TrainSummary s = run_training(c, test::world_env(), false);
  world->barrier().wait();
  if (world->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  EXPECT_NE(s.plan.find(ep > 1 ? "EP " + std::to_string(ep) : std::string("FSDP")), std::string::npos) << s.plan;
  EXPECT_EQ(s.tensor_memory.size(), 2u);
  return s.tensor_memory.back();
}

Plan plan_for(int64_t ep) {
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_small_moe";
  c.args = fsdp::nn::llama::qwen3_flavor("cpu_small_moe");
  c.args.vocab_size = 258;  // fsdp-train's byte-level tokenizer
  c.shard = fsdp::world()->size();
  c.ep = ep;
  c.local_batch = 1;
  c.seq_len = kSeq;
  c.keep_last_block_unsharded = true;  // fsdp_reshard_after_forward = "default"
  return make_plan(c);
}

}  // namespace

TEST(PlanMoEVsTrainer, CpuSmallMoEEp1AndEp2) {
  ASSERT_EQ(fsdp::world()->size(), 4) << "written for 4 ranks";
  for (int64_t ep : {1, 2}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    const auto got = measure(ep);
    const Plan p = plan_for(ep);
    const double fwd = static_cast<double>(got.forward - got.start), peak = static_cast<double>(got.peak - got.start);
    const double pf = static_cast<double>(p.memory.end_of_forward), pp = static_cast<double>(p.memory.step_peak);
    if (fsdp::world()->rank() == 0) {
      std::printf("[plan-moe-trainer] qwen3 cpu_small_moe seq %lld, 4 ranks, ep %lld: step start %.2f MiB (planned "
                  "params + optimizer + buffers %.2f), end of forward +%.2f MiB (planned %.2f, %+.1f%%), step peak "
                  "+%.2f MiB (planned %.2f, %+.1f%%, at %s)\n",
                  static_cast<long long>(kSeq), static_cast<long long>(ep), got.start / 1048576.0,
                  (p.memory.params + p.memory.optimizer + p.memory.buffers) / 1048576.0, fwd / (1 << 20),
                  pf / (1 << 20), 100 * (pf / fwd - 1), peak / (1 << 20), pp / (1 << 20), 100 * (pp / peak - 1),
                  p.memory.peak_moment.c_str());
    }
    EXPECT_NEAR(fwd / pf, 1.0, 0.10) << format_plan(p);
    EXPECT_NEAR(peak / pp, 1.0, 0.25) << format_plan(p);
  }
}
