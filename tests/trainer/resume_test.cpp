// Checkpoint resume of fsdp-train (run under fsdprun with 2 ranks). A run stopped after step 3 (right after its
// checkpoint) and resumed from the latest complete checkpoint equals the uninterrupted run bit for bit (fp32,
// same rank count, data order included); resumed on 1 rank (model and optimizer resharded, the data loader
// repositioned) it equals it within 1e-6. The async save mode gives the same result.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {


std::string shared_dir(const std::string& name) { return test::shared_dir("fsdp_train_resume", name); }

JobConfig base(const std::string& folder, bool checkpoint, const std::string& async_mode = "disabled") {
  JobConfig c = test::checkpointed_job(folder);
  c.metrics.log_freq = 1;
  c.checkpoint.enable = checkpoint;
  c.checkpoint.async_mode = parse_choice<AsyncMode>(async_mode).value();
  return c;
}

TrainEnv dist_env(int64_t stop_after = -1) { return test::world_env(/*verbose=*/true, stop_after); }

void resume_case(const std::string& async_mode) {
  const std::string name = async_mode;
  const TrainSummary full = run_training(base(shared_dir(name + "_full"), false), dist_env(), false);
  ASSERT_EQ(full.losses.size(), 6u);
  ASSERT_NE(full.losses[3], full.losses[0]);  // it trains: a resume from scratch would not match

  const std::string dir = shared_dir(name);
  const TrainSummary first = run_training(base(dir, true, async_mode), dist_env(/*stop_after=*/3), false);
  ASSERT_EQ(first.losses.size(), 3u);
  fsdp::world()->barrier().wait();
  EXPECT_EQ(fsdp::checkpoint::complete_steps(dir + "/checkpoint"), std::vector<int64_t>{3});

  // As if the stopped run had gone on to log step 4 before it died (its checkpoint is step 3's): the resumed run
  // writes step 4 again, once.
  if (fsdp::world()->rank() == 0) std::ofstream(dir + "/metrics.jsonl", std::ios::app) << "{\"step\": 4, \"loss\": -1}\n";
  fsdp::world()->barrier().wait();
  const TrainSummary resumed = run_training(base(dir, true, async_mode), dist_env(), false);
  ASSERT_EQ(resumed.losses.size(), 3u);  // steps 4..6
  if (fsdp::world()->rank() == 0) {
    // One metrics.jsonl for the whole run: steps 1 and 2 of the stopped run (step 3 was checkpointed, then the
    // "crash" came before its log line), 4..6 of the resumed one; each once, each the uninterrupted run's loss.
    std::ifstream in(dir + "/metrics.jsonl");
    std::vector<int64_t> steps;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      steps.push_back(j["step"].get<int64_t>());
      EXPECT_EQ(j["loss"].get<double>(), full.losses[static_cast<size_t>(steps.back() - 1)]) << "step " << steps.back();
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 4, 5, 6}));
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[i + 3]) << "step " << i + 4;  // bit for bit
    EXPECT_EQ(resumed.grad_norms[i], full.grad_norms[i + 3]) << "step " << i + 4;
  }
  fsdp::world()->barrier().wait();
  // The last save is model-only (TorchTitan's default) and complete.
  EXPECT_EQ(fsdp::checkpoint::complete_steps(dir + "/checkpoint"), (std::vector<int64_t>{3, 6}));
  EXPECT_FALSE(fsdp::checkpoint::inspect(dir + "/checkpoint/step-6").values.count("train_state.step"));

  // Another rank count: rank 0 alone (no process group) resumes the 2-rank step-3 checkpoint.
  if (fsdp::world()->rank() == 0) {
    const std::string one = dir + "_one";
    fs::remove_all(one);
    fs::create_directories(one + "/checkpoint");
    fs::copy(dir + "/checkpoint/step-3", one + "/checkpoint/step-3", fs::copy_options::recursive);
    TrainEnv single;
    single.verbose = true;
    const TrainSummary r1 = run_training(base(one, true), single, false);
    ASSERT_EQ(r1.losses.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(r1.losses[i], full.losses[i + 3], 1e-6 * full.losses[i + 3]) << "step " << i + 4 << " on 1 rank";
    }
  }
  fsdp::world()->barrier().wait();
}

}  // namespace

TEST(TrainerResume, StoppedAndResumedEqualsUninterrupted) { resume_case("disabled"); }

TEST(TrainerResume, AsyncSaveResumesTheSame) { resume_case("async"); }
