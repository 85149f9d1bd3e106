// Checkpoints of an MoE model across expert-parallel degrees (4 ranks, qwen3 cpu_tiny_moe, dp_shard 4): a run at
// ep 2 stopped after step 3 (right after its checkpoint) and resumed at ep 2 equals the uninterrupted run bit for
// bit (losses, grad norms, expert loads, final weights and load-balancing biases). The same step-3 checkpoint
// loads at ep 4, without expert parallelism and at tp 2 x ep 2: each trains on like the uninterrupted run (1e-6: other
// reduction orders; the expert loads, which depend on the loaded biases, exactly), and loads the weights bit
// for bit (shown by resuming with a vanishing lr: the final save holds the loaded weights; the biases move
// with the token counts whatever the lr, so they are shown by the expert loads instead). The stacked expert
// tensors are saved whole ([E, F, D]), so any ep degree and Shard(0)/Shard(1) finds its rows.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <tuple>
#include <vector>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

std::string shared_dir(const std::string& name) { return test::shared_dir("fsdp_train_moe_resume", name); }

JobConfig job(const std::string& folder, int64_t ep, int64_t tp = 1) {
  JobConfig c = test::checkpointed_job(folder);
  c.model.name = "qwen3";
  c.model.flavor = "cpu_tiny_moe";
  c.parallelism.expert_parallel_degree = ep;
  c.parallelism.tensor_parallel_degree = tp;
  return c;
}

using test::model_tensors;

bool is_bias(const std::string& key) { return key.find("expert_bias") != std::string::npos; }

void copy_step3(const std::string& from, const std::string& to) {
  if (fsdp::world()->rank() == 0) {
    fs::create_directories(to + "/checkpoint");
    fs::copy(from + "/checkpoint/step-3", to + "/checkpoint/step-3", fs::copy_options::recursive);
  }
  fsdp::world()->barrier().wait();
}

}  // namespace

TEST(TrainerMoEResume, AcrossExpertParallelDegrees) {
  auto world = fsdp::world();
  if (world->size() != 4) GTEST_SKIP() << "dp_shard 4 needs 4 ranks";
  const std::string full_dir = shared_dir("full");
  const TrainSummary full = run_training(job(full_dir, 2), test::world_env(), false);
  ASSERT_EQ(full.losses.size(), 6u);
  EXPECT_NE(full.plan.find("EP 2 ("), std::string::npos) << full.plan;

  const std::string dir = shared_dir("stopped");
  const TrainSummary first = run_training(job(dir, 2), test::world_env(false, /*stop_after=*/3), false);
  ASSERT_EQ(first.losses.size(), 3u);
  world->barrier().wait();
  const auto at3 = model_tensors(dir + "/checkpoint/step-3");
  ASSERT_TRUE(at3.count("layers.0.moe.experts.w1"));
  EXPECT_EQ(at3.at("layers.0.moe.experts.w1").size(0), 8) << "the experts are saved whole";
  ASSERT_TRUE(at3.count("layers.1.moe.expert_bias"));
  EXPECT_GT(at3.at("layers.1.moe.expert_bias").abs().sum().item<double>(), 0) << "the bias moved and was saved";
  // Copies for the resumes at other degrees, before the same-degree resume adds step 6 (shared_dir clears a
  // folder: named once).
  std::map<std::string, std::string> dirs;
  for (const char* tag : {"ep4", "ep1", "tp2_ep2", "ep4_lr0", "ep1_lr0", "tp2_ep2_lr0"}) {
    dirs[tag] = shared_dir(tag);
    copy_step3(dir, dirs[tag]);
  }

  const TrainSummary resumed = run_training(job(dir, 2), test::world_env(), false);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[i + 3]) << "step " << i + 4;
    EXPECT_EQ(resumed.grad_norms[i], full.grad_norms[i + 3]) << "step " << i + 4;
    EXPECT_EQ(resumed.expert_loads[i].max_tokens, full.expert_loads[i + 3].max_tokens) << "step " << i + 4;
  }
  world->barrier().wait();
  const auto want6 = model_tensors(full_dir + "/checkpoint/step-6");
  const auto got6 = model_tensors(dir + "/checkpoint/step-6");
  ASSERT_EQ(want6.size(), got6.size());
  for (const auto& [key, w] : want6) EXPECT_TRUE(torch::equal(got6.at(key), w)) << key;

  // ep 4, no EP, and tp 2 x ep 2 (dp_shard 2: EP borrowing the TP ranks, the experts' FSDP over 2 ranks).
  for (const auto& [tag, ep, tp] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"ep4", 4, 1}, {"ep1", 1, 1}, {"tp2_ep2", 2, 2}}) {
    const TrainSummary other = run_training(job(dirs.at(tag), ep, tp), test::world_env(), false);
    if (ep > 1) EXPECT_NE(other.plan.find("EP " + std::to_string(ep) + " ("), std::string::npos) << other.plan;
    else EXPECT_EQ(other.plan.find("EP "), std::string::npos) << other.plan;
    if (tp > 1) EXPECT_NE(other.plan.find("TP 2 ("), std::string::npos) << other.plan;
    ASSERT_EQ(other.losses.size(), 3u) << tag;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(other.losses[i], full.losses[i + 3], 1e-6 * full.losses[i + 3]) << "step " << i + 4 << " at " << tag;
      EXPECT_EQ(other.expert_loads[i].max_tokens, full.expert_loads[i + 3].max_tokens) << "step " << i + 4 << " at " << tag;
    }
    JobConfig lr0 = job(dirs.at(tag + "_lr0"), ep, tp);
    lr0.optimizer.lr = 1e-30;
    run_training(lr0, test::world_env(), false);
    world->barrier().wait();
    const auto loaded = model_tensors(dirs.at(tag + "_lr0") + "/checkpoint/step-6");
    ASSERT_EQ(loaded.size(), at3.size()) << tag;
    for (const auto& [key, w] : at3) {
      if (!is_bias(key)) EXPECT_TRUE(torch::equal(loaded.at(key), w)) << key << " changed in the reload at " << tag;
    }
  }
}
