// fsdp-plan's MoE memory against fsdp-train's measured tensor memory on 4 ranks: qwen3 cpu_small_moe (4 MoE
// blocks of 8 experts, top-2), FSDP over 4 ranks with ep 1 (experts in the blocks' groups) and ep 2 (experts
// split over rank pairs, their FSDP over the 2 ranks left), float32, one sample of 512 tokens per rank, the
// trainer's default reshard policy. metrics.tensor_memory (a counting allocator around libtorch's CPU
// allocator) gives the second step's live tensor bytes at its start, at the end of forward and at its peak;
// the plan's end_of_forward and step_peak are the same quantities above the persistent state (one micro-batch
// per step: the global batch is the data-parallel ranks' one sample each, world / tp; with 2 micro-batches the
// first one's sharded gradients, 1.2 MiB here, would be live at the second's end of forward). The batches are
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
#include <string>
#include <vector>

using namespace fsdp_train;
using namespace fsdp::plan;

namespace {

constexpr int64_t kSeq = 512;

struct Case {
  int64_t ep = 1, tp = 1;
  bool op_sac = false;
  std::string name() const {
    return "ep" + std::to_string(ep) + "_tp" + std::to_string(tp) + (op_sac ? "_opsac" : "");
  }
};

TrainSummary::TensorMemory measure(const Case& k) {
  auto world = fsdp::world();
  const int64_t ep = k.ep;
  std::vector<std::string> args = {"--model.name", "qwen3", "--model.flavor", "cpu_small_moe", "--training.seq_len",
                             std::to_string(kSeq), "--training.local_batch_size", "1", "--training.global_batch_size",
                             std::to_string(world->size() / k.tp), "--training.steps", "2", "--lr_scheduler.warmup_steps",
                             "1", "--metrics.peak_tflops", "1", "--metrics.tensor_memory", "true",
                             "--parallelism.expert_parallel_degree", std::to_string(ep),
                             "--parallelism.tensor_parallel_degree", std::to_string(k.tp)};
  if (k.op_sac) {
    args.insert(args.end(), {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                             "op"});
  }
  JobConfig c = load_config(args);
  c.job.dump_folder = test::shared_dir("fsdp_plan_moe", k.name());
  const TrainSummary s = run_training(c, test::world_env(), false);
  world->barrier().wait();
  if (world->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  EXPECT_NE(s.plan.find(ep > 1 ? "EP " + std::to_string(ep) : std::string("FSDP")), std::string::npos) << s.plan;
  if (k.tp > 1) EXPECT_NE(s.plan.find("TP " + std::to_string(k.tp)), std::string::npos) << s.plan;
  EXPECT_EQ(s.tensor_memory.size(), 2u);
  return s.tensor_memory.back();
}

Plan plan_for(const Case& k) {
  PlanConfig c;
  c.model = "qwen3";
  c.flavor = "cpu_small_moe";
  c.args = fsdp::models::llama::qwen3_flavor("cpu_small_moe");
  c.args.vocab_size = 258;  // fsdp-train's byte-level tokenizer
  c.tp = k.tp;
  c.shard = fsdp::world()->size() / k.tp;
  c.ep = k.ep;
  if (k.op_sac) {
    c.ac = ACMode::Selective;
    c.selective = SelectiveKind::Op;
  }
  c.local_batch = 1;
  c.seq_len = kSeq;
  c.keep_last_block_unsharded = true;  // fsdp_reshard_after_forward = "default"
  return make_plan(c);
}

void check(const Case& k) {
  SCOPED_TRACE(k.name());
  const auto got = measure(k);
  const Plan p = plan_for(k);
  const double fwd = static_cast<double>(got.forward - got.start), peak = static_cast<double>(got.peak - got.start);
  const double pf = static_cast<double>(p.memory.end_of_forward), pp = static_cast<double>(p.memory.step_peak);
  if (fsdp::world()->rank() == 0) {
    std::printf("[plan-moe-trainer] qwen3 cpu_small_moe seq %lld, 4 ranks, %s: step start %.2f MiB (planned "
                "params + optimizer + buffers %.2f), end of forward +%.2f MiB (planned %.2f, %+.1f%%), step peak "
                "+%.2f MiB (planned %.2f, %+.1f%%, at %s)\n",
                static_cast<long long>(kSeq), k.name().c_str(), got.start / 1048576.0,
                (p.memory.params + p.memory.optimizer + p.memory.buffers) / 1048576.0, fwd / (1 << 20),
                pf / (1 << 20), 100 * (pf / fwd - 1), peak / (1 << 20), pp / (1 << 20), 100 * (pp / peak - 1),
                p.memory.peak_moment.c_str());
  }
  EXPECT_NEAR(fwd / pf, 1.0, 0.10) << format_plan(p);
  EXPECT_NEAR(peak / pp, 1.0, 0.25) << format_plan(p);
}

}  // namespace

TEST(PlanMoEVsTrainer, CpuSmallMoEEp1AndEp2) {
  ASSERT_EQ(fsdp::world()->size(), 4) << "written for 4 ranks";
  for (int64_t ep : {1, 2}) check({ep});
}

// The layouts the planner's MoE models newly cover: tokens sequence-sharded through the MoE block under TP (EP
// borrowing from dp_shard x tp), and op-level SAC keeping the block's odd matmul outputs.
TEST(PlanMoEVsTrainer, CpuSmallMoETp2Ep2AndOpSac) {
  ASSERT_EQ(fsdp::world()->size(), 4) << "written for 4 ranks";
  check({/*ep=*/2, /*tp=*/2});
  check({/*ep=*/2, /*tp=*/1, /*op_sac=*/true});
}
