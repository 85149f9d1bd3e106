// [validation] (run under fsdprun with 2 ranks): the held-out loss is the same on 1 rank and on 2 FSDP ranks
// (and for any validation batch size: the last batch is padded, never dropped), it counts exactly the tokens of
// the held-out text, and validating leaves training bit-identical to a run without it.
#include "config.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

constexpr const char* kHeldOutLine = "Licensed under the Apache License, Version 2.0 (the License). ";
constexpr int kHeldOutRepeats = 41;  // 62 samples of 41 tokens: the last batch is padded on 1 and 2 ranks

// A held-out text of known length: the validation stream is BOS + its bytes + EOS (byte-level tokenizer).
std::string held_out_file() {
  const std::string path = ::testing::TempDir() + "/fsdp_train_validation_heldout.txt";
  std::string text;
  for (int i = 0; i < kHeldOutRepeats; ++i) text += kHeldOutLine;
  // Every rank writes the same bytes to a file of its own and renames it into place: rename is atomic, so no rank
  // ever sees the file truncated by another rank's write (a plain shared ofstream did, and read a size of 0).
  const std::string tmp = path + ".rank" + std::to_string(fsdp::world()->rank()) + ".tmp";
  std::ofstream(tmp) << text;
  fs::rename(tmp, path);
  return path;
}

// The held-out stream's length in tokens, from the text itself rather than from the shared file.
int64_t held_out_stream_tokens() {
  return kHeldOutRepeats * static_cast<int64_t>(std::string(kHeldOutLine).size()) + 2;  // BOS ... EOS
}

JobConfig config(const std::string& name, bool validate, int64_t val_batch, const fs::path& held_out) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "4", "--training.steps", "6", "--lr_scheduler.warmup_steps",
                             "2", "--metrics.peak_tflops", "1", "--metrics.log_freq", "3"});
  c.validation.enable = validate;
  c.validation.dataset = Dataset::Text;
  c.validation.dataset_path = held_out.string();
  c.validation.freq = 3;
  c.validation.steps = -1;
  c.validation.local_batch_size = val_batch;
  c.validation.seq_len = 40;
  // Distributed runs share one folder (only rank 0 writes, and every rank must run the same configuration: the
  // launch check compares them); the 1-rank references, run by each process, get one each.
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_validation_" + name;
  if (name == "ref") c.job.dump_folder += "_rank" + std::to_string(fsdp::world()->rank());
  if (name == "ref" || fsdp::world()->rank() == 0) fs::remove_all(c.job.dump_folder);  // one remover per folder
  fsdp::world()->barrier().wait();
  return c;
}

TrainEnv single() {
  TrainEnv e;
  e.verbose = false;
  return e;
}
TrainEnv distributed() { return test::world_env(); }

}  // namespace

TEST(Validation, SameLossOnOneAndTwoRanksForAnyBatchSize) {
  const std::string held_out = held_out_file();
  const int64_t stream_tokens = held_out_stream_tokens();
  ASSERT_EQ(static_cast<int64_t>(fs::file_size(held_out)) + 2, stream_tokens);
  const TrainSummary ref = run_training(config("ref", true, 3, held_out), single(), false);  // 1 rank, batches of 3
  const TrainSummary got = run_training(config("dist", true, 2, held_out), distributed(), false);
  // Validated at step 1 (TorchTitan validates at the first step) and every 3 steps.
  ASSERT_EQ(ref.validation_steps, (std::vector<int64_t>{1, 3, 6}));
  ASSERT_EQ(got.validation_steps, ref.validation_steps);
  for (size_t i = 0; i < ref.validation_losses.size(); ++i)
    EXPECT_NEAR(got.validation_losses[i], ref.validation_losses[i], 1e-6 * ref.validation_losses[i]) << "validation " << i;
  // The reference moved: training lowers the held-out loss, starting near a uniform guess over the 258 tokens.
  EXPECT_NEAR(ref.validation_losses[0], std::log(258.0) + 0.5, 0.3);
  EXPECT_LT(ref.validation_losses.back(), ref.validation_losses.front() - 0.1);
  // The JSONL holds a validation record per validation with the exact token count: every complete sample of
  // 41 tokens, 40 labels each (rank 0's file on the distributed run).
  std::ifstream in(::testing::TempDir() + "/fsdp_train_validation_dist/metrics.jsonl");
  if (fsdp::world()->rank() == 0) {
    ASSERT_TRUE(in.good());
    std::string line;
    int validations = 0;
    while (std::getline(in, line)) {
      if (line.find("validation_loss") == std::string::npos) continue;
      ++validations;
      const std::string expect = "\"validation_tokens\":" + std::to_string(stream_tokens / 41 * 40);
      EXPECT_NE(line.find(expect), std::string::npos) << line << " (expected " << expect << ")";
    }
    EXPECT_EQ(validations, 3);
  }
}

TEST(Validation, LeavesTrainingBitIdentical) {
  const std::string held_out = held_out_file();
  const TrainSummary without = run_training(config("off", false, 2, held_out), distributed(), false);
  const TrainSummary with = run_training(config("on", true, 2, held_out), distributed(), false);
  ASSERT_EQ(with.validation_steps.size(), 3u);  // it ran
  EXPECT_TRUE(without.validation_steps.empty());
  EXPECT_EQ(with.losses, without.losses);  // bit for bit
  EXPECT_EQ(with.grad_norms, without.grad_norms);
  EXPECT_LT(with.losses.back(), with.losses.front());
}
