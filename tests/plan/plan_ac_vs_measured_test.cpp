// fsdp-plan's activation-checkpointing estimates against the trainer's measured tensor memory (2 ranks, FSDP):
// fsdp-train runs in this process with metrics.tensor_memory (a counting allocator around libtorch's CPU
// allocator, apps/fsdp-train/tensor_memory.h) for AC none, full, every-2nd-block and op-level SAC, and the
// second step's live tensor bytes are compared with the plan:
//   end of forward - step start  (saved activations + the last block's and the root's unsharded params + logits
//                                  and log-softmax)  == plan.memory.end_of_forward  within 10%
//   step peak - step start                            == plan.memory.step_peak       within 20% (the backward
//                                  workspace model is rough and over-estimates; see docs/planner.md)
// The step start is sharded params + optimizer states (grads were freed by zero_grad), the planner's persistent
// state without the runtime overhead (which is not tensors).
#include "config.h"
#include "plan.h"
#include "trainer.h"
#include "trainer/train_env.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

using namespace fsdp_train;
using namespace fsdp::plan;

namespace {

struct Mode {
  const char* mode;
  const char* option;
};
constexpr Mode kModes[] = {{"none", "2"}, {"full", "2"}, {"selective", "2"}, {"selective", "op"}};

TrainSummary::TensorMemory measure(const std::string& flavor, int64_t seq, const Mode& m, int64_t tp) {
  JobConfig c = load_config({"--model.flavor", flavor, "--training.seq_len", std::to_string(seq),
                             "--training.local_batch_size", "1", "--training.global_batch_size",
                             std::to_string(fsdp::world()->size() / tp),  // one sample per data-parallel rank
                             "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.peak_tflops",
                             "1", "--metrics.tensor_memory", "true", "--activation_checkpoint.mode", m.mode,
                             "--activation_checkpoint.selective_ac_option", m.option,
                             "--parallelism.tensor_parallel_degree", std::to_string(tp)});
  auto world = fsdp::world();
  // One folder for all ranks: the launch check requires the same effective configuration on every rank.
  c.job.dump_folder = test::shared_dir("fsdp_plan_ac", flavor + m.mode + m.option + "_tp" + std::to_string(tp));
  const TrainSummary s = run_training(c, test::world_env(), false);
  world->barrier().wait();  // every rank is done with the folder
  if (world->rank() == 0) std::filesystem::remove_all(c.job.dump_folder);
  EXPECT_EQ(s.tensor_memory.size(), 2u);
  return s.tensor_memory.back();  // step 2: the optimizer states exist at its start
}

Plan plan_for(const std::string& flavor, int64_t seq, const Mode& m, int64_t world, int64_t tp) {
  PlanConfig c;
  c.flavor = flavor;
  c.args = fsdp::models::llama::llama3_flavor(flavor);
  c.args.vocab_size = 258;  // fsdp-train's byte-level tokenizer
  c.shard = world / tp;
  c.tp = tp;  // TorchTitan's Llama plan with sequence and loss parallel, as fsdp-train applies it
  c.local_batch = 1;
  c.seq_len = seq;
  c.keep_last_block_unsharded = true;  // fsdp_reshard_after_forward = "default"
  c.ac = parse_ac_mode(m.mode);
  c.selective = std::string(m.option) == "op" ? SelectiveKind::Op : SelectiveKind::Layer;
  c.selective_every = std::string(m.option) == "op" ? 2 : std::stoll(m.option);
  return make_plan(c);
}

void check(const std::string& flavor, int64_t seq, int64_t tp = 1) {
  const int64_t world = fsdp::world()->size();
  double none_fwd = 0;
  for (const Mode& m : kModes) {
    SCOPED_TRACE(std::string(m.mode) + " " + m.option + " tp " + std::to_string(tp));
    const auto got = measure(flavor, seq, m, tp);
    const Plan p = plan_for(flavor, seq, m, world, tp);
    const double fwd = static_cast<double>(got.forward - got.start), peak = static_cast<double>(got.peak - got.start);
    const double pf = static_cast<double>(p.memory.end_of_forward), pp = static_cast<double>(p.memory.step_peak);
    if (std::string(m.mode) == "none") none_fwd = fwd;
    if (fsdp::world()->rank() == 0) {
      std::printf("[plan-ac] %s seq %lld tp %lld AC %s %s: end of forward %.2f MiB (planned %.2f, %+.1f%%; %.0f%% of no AC), "
                  "step peak %.2f MiB (planned %.2f, %+.1f%%); planned saved activations %.2f MiB\n",
                  flavor.c_str(), static_cast<long long>(seq), static_cast<long long>(tp), m.mode, m.option, fwd / (1 << 20), pf / (1 << 20),
                  100 * (fwd / pf - 1), 100 * fwd / none_fwd, peak / (1 << 20), pp / (1 << 20), 100 * (peak / pp - 1),
                  static_cast<double>(p.memory.saved_activations) / (1 << 20));
    }
    EXPECT_NEAR(fwd / pf, 1.0, 0.10) << format_plan(p);
    EXPECT_NEAR(peak / pp, 1.0, 0.20) << format_plan(p);
    if (std::string(m.mode) != "none") EXPECT_LT(fwd, none_fwd);
  }
}

}  // namespace

TEST(PlanAcVsMeasured, CpuSmallSeq512) { check("cpu_small", 512); }
// Tensor parallel 2 (sequence + loss parallel) on the 2 ranks: the planner's TP activation split.
TEST(PlanAcVsMeasured, TensorParallel2CpuSmallSeq512) { check("cpu_small", 512, 2); }
// The bench/RESULTS.md numbers: long sequences on the must-show flavors.
TEST(PlanAcVsMeasured, SlowCpuMediumSeq1024) { check("cpu_medium", 1024); }
TEST(PlanAcVsMeasured, SlowDebugmodelSeq2048) { check("debugmodel", 2048); }
