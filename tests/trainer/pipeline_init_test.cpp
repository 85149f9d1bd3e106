// Under pipeline parallelism each rank initialises only its own stages (the others' parts stay on meta and draw
// nothing: src/models/generator_skip.h), and the trainer's initial weights are still the 1-rank init's bit for bit:
// Llama 3 pp 2 (Interleaved1F1B, 4 stages) and DeepSeek-V3 pp 2 (1F1B) on 2 ranks; Llama 3 pp 4 (1F1B) and
// Qwen3-MoE pp 2 x dp_shard 2 (fully_shard inside each stage) on 4 ranks. The weights are read from the checkpoint
// after one step at lr 1e-30 (an update far below float32's resolution at these magnitudes: the saved weights are
// the initial ones) and compared with the same job run on rank 0 alone, without a process group (the whole model
// initialised on the CPU in one piece), and with that job under another seed (the seed moves the weights).
// Also: the config's pipeline_parallel_schedule is the library's ScheduleKind, with the library's names.
#include "train_env.h"

#include <fsdp/pipeline/schedule.h>

#include <cctype>

using namespace fsdp_train;

namespace {

// 4 samples a rank and step (4 microbatches of 1 under PP), `global_batch` a step.
JobConfig one_step_job(const std::string& folder, const std::string& model, const std::string& flavor, int64_t pp,
                       PipelineSchedule schedule, int64_t global_batch) {
  JobConfig c = load_config({"--model.name", model, "--model.flavor", flavor, "--training.seq_len", "32",
                             "--training.local_batch_size", "4", "--training.global_batch_size",
                             std::to_string(global_batch), "--training.steps", "1", "--optimizer.lr", "1e-30",
                             "--lr_scheduler.warmup_steps", "0", "--training.mixed_precision_param", "float32"});
  c.job.dump_folder = folder;
  c.validation.enable = false;
  c.checkpoint.enable = true;
  c.checkpoint.interval = 1;
  c.parallelism.pipeline_parallel_degree = pp;
  c.parallelism.pipeline_parallel_schedule = schedule;
  c.parallelism.pipeline_parallel_microbatch_size = 1;
  return c;
}

// The model tensors of the checkpoint after one step at lr 1e-30, run on this process alone (no process group: the
// whole model built on the CPU and initialised in one piece: the 1-rank init), seeded with `seed`.
std::map<std::string, at::Tensor> one_rank_initial_weights(const std::string& folder, const std::string& model,
                                                           const std::string& flavor, int64_t global_batch,
                                                           int64_t seed) {
  // The same global batch (accumulated here): MoE's expert_bias, a buffer the step's expert loads move, matches too.
  JobConfig c = one_step_job(folder, model, flavor, 1, PipelineSchedule::OneFOneB, global_batch);
  c.debug.seed = seed;
  TrainEnv single;
  single.verbose = false;
  run_training(c, single, false);
  return test::model_tensors(folder + "/checkpoint/step-1");
}

void expect_initial_weights_of_one_rank(const std::string& model, const std::string& flavor, int64_t pp,
                                        PipelineSchedule schedule, const std::string& plan_text) {
  SCOPED_TRACE(model + " " + flavor + " pp " + std::to_string(pp) + " " + to_string(schedule));
  const std::string dir = test::shared_dir("fsdp_train_pp_init", model + "_" + std::to_string(pp));
  const int64_t global_batch = 4 * (fsdp::world()->size() / pp);
  const JobConfig config = one_step_job(dir + "/pp", model, flavor, pp, schedule, global_batch);
  const TrainSummary got = run_training(config, test::world_env(), false);
  EXPECT_NE(got.plan.find(plan_text), std::string::npos) << got.plan;
  if (fsdp::world()->rank() == 0) {
    const auto saved = test::model_tensors(dir + "/pp/checkpoint/step-1");
    const auto want = one_rank_initial_weights(dir + "/one_rank", model, flavor, global_batch, config.debug.seed);
    const auto other_seed = one_rank_initial_weights(dir + "/other_seed", model, flavor, global_batch,
                                                     config.debug.seed + 1);
    ASSERT_EQ(saved.size(), want.size());
    int moved = 0;
    for (const auto& [name, value] : want) {
      ASSERT_TRUE(saved.count(name)) << name;
      EXPECT_TRUE(torch::equal(saved.at(name), value)) << name;
      moved += !torch::equal(value, other_seed.at(name));
    }
    EXPECT_GT(moved, static_cast<int>(want.size()) / 2);  // the seed reaches the weights (norms stay at 1)
  }
  fsdp::world()->barrier().wait();
}

}  // namespace

// pipeline_parallel_schedule is the library's ScheduleKind: the config's names are the library's (Csv, a file,
// is no name of the key).
TEST(TrainerPipelineInit, ConfigScheduleNamesAreTheLibrarys) {
  using fsdp::pipeline::ScheduleKind;
  int named = 0;
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::LoopedBFS,
                            ScheduleKind::Interleaved1F1B, ScheduleKind::InterleavedZeroBubble,
                            ScheduleKind::ZBVZeroBubble, ScheduleKind::DualPipeV}) {
    const std::string name = fsdp::pipeline::schedule_name(kind);
    EXPECT_EQ(to_string(kind), name);
    std::string lower = name;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    EXPECT_EQ(parse_choice<PipelineSchedule>(lower), kind) << lower;
    EXPECT_EQ(fsdp::pipeline::parse_schedule_name(lower), kind) << lower;
    ++named;
  }
  EXPECT_EQ(named, 7);
  EXPECT_FALSE(parse_choice<PipelineSchedule>("csv").has_value());
}

TEST(TrainerPipelineInit, StagesHoldTheOneRankInitialWeights) {
  const int world = fsdp::world()->size();
  if (world == 2) {
    expect_initial_weights_of_one_rank("llama3", "cpu_tiny", 2, PipelineSchedule::Interleaved1F1B,
                                       "PP 2 (Interleaved1F1B, 4 stages");
    expect_initial_weights_of_one_rank("deepseek_v3", "cpu_tiny", 2, PipelineSchedule::OneFOneB,
                                       "PP 2 (1F1B, 2 stages");
  } else if (world == 4) {
    expect_initial_weights_of_one_rank("llama3", "cpu_tiny", 4, PipelineSchedule::OneFOneB, "PP 4 (1F1B, 4 stages");
    expect_initial_weights_of_one_rank("qwen3", "cpu_tiny_moe", 2, PipelineSchedule::Interleaved1F1B,
                                       "PP 2 (Interleaved1F1B, 4 stages");
  } else {
    GTEST_SKIP() << "pp 2 on 2 ranks, pp 4 and pp 2 x dp_shard 2 on 4";
  }
}
