// The training loop on one process: it learns, it writes its metrics, it is deterministic, and gradient
// accumulation does not change the loss curve (loss normalised by the global token count); the layout check runs
// once per run.
#include "config.h"
#include "trainer.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

using namespace fsdp_train;

namespace {
JobConfig tiny(const std::string& name, int64_t local, int64_t global, int64_t steps) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size",
                             std::to_string(local), "--training.global_batch_size", std::to_string(global),
                             "--training.steps", std::to_string(steps), "--lr_scheduler.warmup_steps", "5",
                             "--metrics.peak_tflops", "1", "--metrics.log_freq", "10",
                             "--validation.enable", "false"});
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_loop_" + name;
  std::filesystem::remove_all(c.job.dump_folder);
  return c;
}
TrainEnv quiet() {
  TrainEnv env;
  env.verbose = false;
  return env;
}
}  // namespace

TEST(TrainingLoop, LearnsAndWritesMetrics) {
  const JobConfig c = tiny("learn", 4, 8, 40);
  const TrainSummary s = run_training(c, quiet());
  ASSERT_EQ(s.losses.size(), 40u);
  // At init the final norm gives unit-RMS features and output.weight has std dim^-0.5, so the logits are
  // roughly N(0, 1): the expected loss is ln(vocab) + 1/2 (log-normal partition function).
  EXPECT_NEAR(s.losses[0], std::log(258.0) + 0.5, 0.15);
  EXPECT_LT(s.final_loss, s.losses[0] - 1.5);
  EXPECT_GT(s.unigram_entropy, 2.0);  // byte-level English text: ~3 nats
  EXPECT_LT(s.unigram_entropy, 4.0);
  std::ifstream in(c.job.dump_folder + "/metrics.jsonl");
  std::string line;
  int records = 0;
  while (std::getline(in, line)) ++records;
  EXPECT_EQ(records, 5);  // steps 1, 10, 20, 30, 40
  EXPECT_TRUE(std::filesystem::exists(c.job.dump_folder + "/config.toml"));
}

TEST(TrainingLoop, DeterministicAndAccumulationInvariant) {
  const TrainSummary a = run_training(tiny("acc1", 8, 8, 6), quiet(), false);
  const TrainSummary b = run_training(tiny("acc1b", 8, 8, 6), quiet(), false);
  EXPECT_EQ(a.losses, b.losses);  // bit for bit
  // The same global batches as 2 micro-batches of 4: the same loss curve up to summation order.
  const TrainSummary c = run_training(tiny("acc2", 4, 8, 6), quiet(), false);
  ASSERT_EQ(a.losses.size(), c.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], c.losses[i], 1e-5 * a.losses[i]) << "step " << i + 1;
}

// training.device names the mesh's device; one this process does not have is a ConfigError at start, naming the key.
TEST(TrainingLoop, UnavailableDeviceIsAConfigErrorNamingTheKey) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA is available here";
  JobConfig c = tiny("no_cuda", 4, 8, 2);
  c.training.device = "cuda";
  try {
    run_training(c, quiet());
    FAIL() << "training.device = cuda ran without CUDA";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("training.device = \"cuda\": CUDA is not available"), std::string::npos)
        << e.what();
  }
}

// The model family's layout check (under PP its split: a throwaway schedule) runs once per training run:
// fsdp-train's start (check_and_init_distributed) checks before any process group and the Trainer trusts that
// (TrainEnv::layout_checked); a caller of run_training that did not start that way gets the check in the Trainer.
TEST(TrainingLoop, LayoutCheckedOncePerRunWhicheverWayItStarts) {
  ASSERT_EQ(std::getenv("WORLD_SIZE"), nullptr) << "one process without a launcher: no rendezvous here";
  const JobConfig c = tiny("layout_once", 4, 8, 1);
  TrainEnv started = check_and_init_distributed(c);
  EXPECT_TRUE(started.layout_checked) << "fsdp-train's start checks before the process group";
  started.verbose = false;
  const TrainSummary from_start = run_training(c, started, false);
  EXPECT_EQ(from_start.losses.size(), 1u);
  EXPECT_FALSE(from_start.layout_checked_by_trainer) << "the Trainer checked the layout fsdp-train's start had checked";
  const TrainEnv caller = quiet();
  ASSERT_FALSE(caller.layout_checked);
  const TrainSummary from_caller = run_training(tiny("layout_caller", 4, 8, 1), caller, false);
  EXPECT_EQ(from_caller.losses.size(), 1u);
  EXPECT_TRUE(from_caller.layout_checked_by_trainer) << "a run_training caller's layout went unchecked";
}
