// The metrics processor (apps/fsdp-train/metrics_processor.h) from records alone, without a model: what it
// writes to metrics.jsonl for given StepMetrics (the trainer's values untouched, throughput from the window it
// was told about), validation lines, the MoE expert-load fields, which steps it logs, and that the first window
// is left out of the mean throughput.
#include "config.h"
#include "metrics_processor.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

using namespace fsdp_train;

namespace {

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

JobConfig job(const std::string& name) {
  JobConfig c = load_config({"--metrics.log_freq", "2"});
  c.job.dump_folder = ::testing::TempDir() + "/fsdp_metrics_processor_" + name;
  std::filesystem::remove_all(c.job.dump_folder);
  return c;
}

}  // namespace

TEST(MetricsProcessor, WritesTheRecordAndItsWindowsThroughput) {
  const JobConfig c = job("records");
  MetricsProcessor p(c, /*rank=*/0, /*verbose=*/false);
  EXPECT_TRUE(p.should_log(1, false));
  EXPECT_FALSE(p.should_log(3, false));
  EXPECT_TRUE(p.should_log(4, false));
  EXPECT_TRUE(p.should_log(5, /*last=*/true));

  p.start();
  p.add_step(/*local_tokens=*/1000, /*data_seconds=*/0.01);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  StepMetrics m1;
  m1.step = 1;
  m1.loss = 2.5;
  m1.grad_norm = 0.75;
  m1.lr = 1e-3;
  p.log(m1, /*flops_per_token=*/1e6, /*peak_tflops=*/1.0);
  // 1000 tokens in at least 50 ms: at most 20,000 tokens/s, and tflops / mfu follow from it.
  EXPECT_GT(m1.tps, 0);
  EXPECT_LE(m1.tps, 20000.0 * 1.0001);
  EXPECT_NEAR(m1.tflops, 1e6 * m1.tps / 1e12, 1e-15);
  EXPECT_NEAR(m1.mfu, 100 * m1.tflops, 1e-12);
  EXPECT_DOUBLE_EQ(m1.data_s, 0.01);

  // Second window: two steps, an MoE record; the validation in between is left out of the window.
  const auto t0 = std::chrono::steady_clock::now();
  p.add_step(500, 0.0);
  p.add_step(500, 0.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a validation of 80 ms inside the window
  p.log_validation(2, 3.0, std::exp(3.0), 640, 1234.0, /*seconds=*/0.08);
  StepMetrics m2;
  m2.step = 2;
  m2.loss = 2.0;
  m2.expert_tokens_min = {1, 0};
  m2.expert_tokens_max = {9, 12};
  m2.expert_tokens_mean = 4;
  p.log(m2, 1e6, 1.0);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(m2.tps, 1000.0 / (wall - 0.08) * 0.999) << "the 80 ms of validation must not count in the window";
  EXPECT_NEAR(m2.step_s * 2, 1000.0 / m2.tps, 1e-9);
  // The mean leaves out the first window (one-time costs).
  EXPECT_DOUBLE_EQ(p.mean_tps(), m2.tps);

  const auto lines = read_jsonl(c.job.dump_folder + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_DOUBLE_EQ(lines[0]["loss"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(lines[0]["grad_norm"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(lines[0]["tps"].get<double>(), m1.tps);
  EXPECT_FALSE(lines[0].contains("expert_tokens_max")) << "dense records carry no MoE fields";
  EXPECT_EQ(lines[1]["step"], 2);
  EXPECT_DOUBLE_EQ(lines[1]["validation_loss"].get<double>(), 3.0);
  EXPECT_EQ(lines[1]["validation_tokens"], 640);
  EXPECT_EQ(lines[2]["expert_tokens_min"], (std::vector<double>{1, 0}));
  EXPECT_EQ(lines[2]["expert_tokens_max"], (std::vector<double>{9, 12}));
  EXPECT_DOUBLE_EQ(lines[2]["expert_tokens_mean"].get<double>(), 4);
  ASSERT_EQ(p.outputs().size(), 1u);
  EXPECT_EQ(p.outputs()[0].second, c.job.dump_folder + "/metrics.jsonl");
}

TEST(MetricsProcessor, AResumedRunKeepsTheEarlierStepsAndRewritesTheRest) {
  // A run logged steps 1..5 (and a line a crash cut short), its checkpoint was at step 3: the resumed run's first
  // record is step 4. Steps 1..3 stay, the stale 4 and 5 and the broken line go, 4 and 5 come again once each.
  const JobConfig c = job("resume");
  const std::string path = c.job.dump_folder + "/metrics.jsonl";
  std::filesystem::create_directories(c.job.dump_folder);
  {
    std::ofstream out(path);
    for (int step = 1; step <= 5; ++step) out << "{\"step\": " << step << ", \"loss\": " << 10 - step << "}\n";
    out << "{\"step\": 6, \"lo";
  }
  {
    MetricsProcessor p(c, /*rank=*/0, /*verbose=*/false);
    std::ifstream in(path);
    EXPECT_EQ(std::count(std::istreambuf_iterator<char>(in), {}, '\n'), 5) << "nothing is dropped before a record";
    p.start();
    for (int step = 4; step <= 5; ++step) {
      p.add_step(100, 0.0);
      StepMetrics m;
      m.step = step;
      m.loss = 1.0 * step;
      p.log(m, 1e6, 1.0);
    }
  }
  const auto lines = read_jsonl(path);
  ASSERT_EQ(lines.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(lines[i]["step"], i + 1);
  EXPECT_DOUBLE_EQ(lines[2]["loss"].get<double>(), 7.0);  // the earlier run's step 3
  EXPECT_DOUBLE_EQ(lines[3]["loss"].get<double>(), 4.0);  // the resumed run's step 4
  EXPECT_DOUBLE_EQ(lines[4]["loss"].get<double>(), 5.0);

  // A fresh run (first record step 1) starts the file anew.
  {
    MetricsProcessor p(c, 0, false);
    p.start();
    p.add_step(100, 0.0);
    StepMetrics m;
    m.step = 1;
    p.log(m, 1e6, 1.0);
  }
  EXPECT_EQ(read_jsonl(path).size(), 1u);
}

TEST(MetricsProcessor, OtherRanksWriteNothingUnlessAsked) {
  JobConfig c = job("ranks");
  {
    MetricsProcessor p(c, /*rank=*/1, false);
    EXPECT_TRUE(p.outputs().empty());
  }
  c.metrics.save_for_all_ranks = true;
  MetricsProcessor p(c, 1, false);
  ASSERT_EQ(p.outputs().size(), 1u);
  EXPECT_EQ(p.outputs()[0].second, c.job.dump_folder + "/metrics_rank1.jsonl");
}

TEST(MetricsProcessor, TensorBoardGetsTheMoeScalars) {
  JobConfig c = job("tb");
  c.metrics.enable_tensorboard = true;
  MetricsProcessor p(c, 0, false);
  p.add_step(10, 0);
  StepMetrics m;
  m.step = 1;
  m.expert_tokens_min = {3};
  m.expert_tokens_max = {7};
  p.log(m, 1, 1);
  ASSERT_FALSE(p.tensorboard_dir().empty());
  std::string all;
  for (const auto& f : std::filesystem::directory_iterator(p.tensorboard_dir())) {
    std::ifstream in(f.path(), std::ios::binary);
    all += std::string(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_NE(all.find("moe/layer_0/expert_tokens_max"), std::string::npos);
  EXPECT_NE(all.find("loss_metrics/global_avg_loss"), std::string::npos);
}
