// TensorBoard event files: a short run with metrics.enable_tensorboard and validation, read back by the
// `tensorboard` Python package (its own record reader and CRC32C checks): every TorchTitan scalar is there, at
// the steps of the JSONL records, with the JSONL's values. A corrupted byte is caught by TensorBoard's CRC check.
#include "config.h"
#include "tensorboard.h"
#include "trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << cmd;
  return out;
}

nlohmann::json read_with_tensorboard(const std::string& dir) {
  const std::string out = run_capture(std::string(FSDP_TEST_PYTHON) + " " + FSDP_SOURCE_DIR +
                                      "/tests/trainer/read_tensorboard.py " + dir);
  return nlohmann::json::parse(out);
}

bool python_has_tensorboard() {
  return std::system((std::string(FSDP_TEST_PYTHON) + " -c 'import tensorboard' > /dev/null 2>&1").c_str()) == 0;
}

}  // namespace

TEST(TensorBoard, Crc32cOfTheStandardCheckString) {
  // RFC 3720 (iSCSI) B.4: CRC32C("123456789") = 0xE3069283; 32 zero bytes = 0x8A9136AA.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::vector<char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TensorBoard, TensorBoardReadsEveryScalarWithTheJsonlValues) {
  if (!python_has_tensorboard()) GTEST_SKIP() << FSDP_TEST_PYTHON << " has no tensorboard (scripts/setup.sh installs it)";
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "2", "--training.steps", "6", "--lr_scheduler.warmup_steps",
                             "2", "--metrics.peak_tflops", "1", "--metrics.log_freq", "2", "--metrics.enable_tensorboard",
                             "--validation.freq", "3", "--validation.steps", "2", "--validation.seq_len", "32"});
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_train_tensorboard";
  fs::remove_all(c.job.dump_folder);
  TrainEnv env;
  env.verbose = false;
  const TrainSummary s = run_training(c, env, false);
  ASSERT_EQ(s.validation_steps, (std::vector<int64_t>{1, 3, 6}));

  // The JSONL records (written by a separate code path) are the reference.
  std::map<std::string, std::vector<std::pair<int64_t, double>>> expect;
  std::ifstream in(c.job.dump_folder + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    const int64_t step = j["step"];
    if (j.contains("validation_loss")) {
      expect["validation_metrics/loss"].push_back({step, j["validation_loss"]});
      expect["validation_metrics/perplexity"].push_back({step, j["validation_perplexity"]});
      continue;
    }
    expect["loss_metrics/global_avg_loss"].push_back({step, j["loss"]});
    expect["grad_norm"].push_back({step, j["grad_norm"]});
    expect["lr/AdamW"].push_back({step, j["lr"]});
    expect["throughput(tps)"].push_back({step, j["tps"]});
    expect["tflops"].push_back({step, j["tflops"]});
    expect["mfu(%)"].push_back({step, j["mfu"]});
    expect["memory/max_reserved(GiB)"].push_back({step, j["memory_gib"]});
  }
  ASSERT_EQ(expect["grad_norm"].size(), 4u);  // steps 1, 2, 4, 6
  ASSERT_EQ(expect["validation_metrics/loss"].size(), 3u);

  const auto tb = read_with_tensorboard(c.job.dump_folder + "/" + c.metrics.save_tb_folder);
  EXPECT_EQ(tb["files"], 1);
  EXPECT_EQ(tb["file_version"], "brain.Event:2");
  const auto& scalars = tb["scalars"];
  for (const auto& [tag, points] : expect) {
    ASSERT_TRUE(scalars.contains(tag)) << tag << " missing; TensorBoard found " << scalars.dump();
    const auto& got = scalars[tag];
    ASSERT_EQ(got.size(), points.size()) << tag;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(got[i][0].get<int64_t>(), points[i].first) << tag;
      // simple_value is a float32.
      EXPECT_EQ(got[i][1].get<double>(), static_cast<double>(static_cast<float>(points[i].second))) << tag << " step " << points[i].first;
    }
  }
  // TorchTitan's other names are there too, at the training log steps.
  for (const char* tag : {"loss_metrics/global_max_loss", "time_metrics/end_to_end(s)", "time_metrics/data_loading(s)",
                          "time_metrics/data_loading(%)", "validation_metrics/throughput(tps)"})
    EXPECT_TRUE(scalars.contains(tag)) << tag;
  // One data-parallel rank: the max over ranks is the mean.
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(scalars["loss_metrics/global_max_loss"][i][1], scalars["loss_metrics/global_avg_loss"][i][1]);

  // Flip one byte of the last record's payload in a copy: TensorBoard's CRC check stops before it.
  const fs::path corrupt = c.job.dump_folder + "/corrupt";
  fs::create_directories(corrupt);
  fs::path events;
  for (const auto& e : fs::recursive_directory_iterator(c.job.dump_folder + "/" + c.metrics.save_tb_folder))
    if (e.path().filename().string().find("tfevents") != std::string::npos) events = e.path();
  const fs::path copy = corrupt / events.filename();
  fs::copy_file(events, copy);
  {
    std::fstream f(copy, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-8, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    b ^= 0x20;
    f.seekp(-8, std::ios::end);
    f.write(&b, 1);
  }
  const auto bad = read_with_tensorboard(corrupt.string());
  size_t good_points = 0, bad_points = 0;
  for (const auto& [tag, v] : scalars.items()) good_points += v.size();
  for (const auto& [tag, v] : bad["scalars"].items()) bad_points += v.size();
  EXPECT_EQ(bad_points + 1, good_points);
}
