#pragma once
// What the multi-rank trainer tests share: the TrainEnv of this rank of the fsdprun world, and one scratch
// folder per job that every rank names the same.
#include "config.h"
#include "trainer.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/process_group.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace fsdp_train::test {

// This rank of the world group runs the job (every rank of the test calls run_training with its own).
inline TrainEnv world_env(bool verbose = false, int64_t stop_after_step = -1) {
  auto world = fsdp::world();
  TrainEnv env;
  env.rank = world->rank();
  env.world_size = world->size();
  env.group = world;
  env.verbose = verbose && world->rank() == 0;
  env.stop_after_step = stop_after_step;
  return env;
}

// The same folder on every rank (fsdprun, every rank's parent, makes it unique per launch); rank 0 clears it and
// every rank waits for that. Collective.
inline std::string shared_dir(const std::string& prefix, const std::string& name) {
  const std::string d = ::testing::TempDir() + "/" + prefix + "_" + name + "_" + std::to_string(::getppid());
  if (fsdp::world()->rank() == 0) std::filesystem::remove_all(d);
  fsdp::world()->barrier().wait();
  return d;
}

// A JSON Lines corpus of `count` short documents (min_chars .. min_chars + spread - 1 characters of a 17-letter
// alphabet with spaces, from `seed`), so that packed rows hold several documents and documents cross chunk
// boundaries (block_causal tests); written by rank 0 into a shared_dir folder every rank names the same.
// Collective. Returns the file's path.
inline std::string short_documents_corpus(const std::string& prefix, int count, uint32_t min_chars, uint32_t spread,
                                          uint32_t seed) {
  const std::string dir = shared_dir(prefix, "docs");
  const std::string path = dir + "/docs.jsonl";
  if (fsdp::world()->rank() == 0) {
    std::filesystem::create_directories(dir);
    std::ofstream out(path);
    uint32_t state = seed;
    for (int i = 0; i < count; ++i) {
      state = state * 1103515245u + 12345u;
      std::string text(min_chars + (state >> 16) % spread, ' ');
      for (auto& ch : text) {
        state = state * 1103515245u + 12345u;
        ch = "abcdefgh ijklmnop"[(state >> 16) % 17];
      }
      out << "{\"text\": \"" << text << "\"}\n";
    }
  }
  fsdp::world()->barrier().wait();
  return path;
}

// The checkpoint tests' job: cpu_tiny, 6 steps of a global batch of 8 in fp32 (bit-for-bit comparable), saving
// every 3 steps into `folder` and keeping every checkpoint.
inline JobConfig checkpointed_job(const std::string& folder) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "8", "--training.steps", "6", "--lr_scheduler.warmup_steps",
                             "2", "--metrics.peak_tflops", "1", "--training.mixed_precision_param", "float32"});
  c.job.dump_folder = folder;
  c.checkpoint.enable = true;
  c.checkpoint.interval = 3;
  c.checkpoint.keep_latest_k = 0;
  return c;
}

// The model tensors of a (model-only or full) checkpoint, read whole (optimizer states left out).
inline std::map<std::string, at::Tensor> model_tensors(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  for (const auto& t : fsdp::checkpoint::inspect(dir).tensors) {
    if (t.name.rfind("optimizer.", 0) == 0) continue;
    out[t.name] = fsdp::checkpoint::read_tensor(dir, t.name);
  }
  return out;
}

// Writes `text` to `path` from every rank: a private temporary then a rename, so that no rank reads a half-written
// file (every rank must name the same file: the launch check compares configurations).
inline std::string write_shared_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(fsdp::world()->rank());
  std::ofstream(tmp, std::ios::binary) << text;
  std::filesystem::rename(tmp, path);
  return path;
}

// An MoE run against its 1-rank reference, step by step: loss (1e-5) and grad norm (1e-4) relative, each of the
// `moe_layers` layers' busiest and idlest expert load exactly (the mean too when `compare_mean`: every token of the
// batch counted once), the load-balancing bias's L1 norm (1e-9). True when some expert got no token from some rank
// in some step (the zero-token path ran).
inline bool expect_moe_steps_equal(const TrainSummary& ref, const TrainSummary& got, size_t moe_layers,
                                   bool compare_mean = false) {
  EXPECT_EQ(ref.expert_loads.size(), ref.losses.size()) << "one expert-load record per step";
  EXPECT_EQ(got.losses.size(), ref.losses.size());
  EXPECT_EQ(got.expert_loads.size(), ref.expert_loads.size());
  if (got.losses.size() != ref.losses.size() || got.expert_loads.size() != ref.losses.size() ||
      ref.expert_loads.size() != ref.losses.size())
    return false;
  bool some_expert_idle_on_a_rank = false;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "step " << i + 1;
    const ExpertLoad &r = ref.expert_loads[i], &g = got.expert_loads[i];
    EXPECT_EQ(r.min_tokens.size(), moe_layers) << "MoE layers";
    EXPECT_EQ(g.min_tokens, r.min_tokens) << "step " << i + 1;
    EXPECT_EQ(g.max_tokens, r.max_tokens) << "step " << i + 1;
    if (compare_mean) EXPECT_EQ(g.mean_tokens, r.mean_tokens) << "step " << i + 1;
    EXPECT_NEAR(g.bias_l1, r.bias_l1, 1e-9) << "step " << i + 1;
    some_expert_idle_on_a_rank = some_expert_idle_on_a_rank || g.min_local_tokens == 0;
  }
  return some_expert_idle_on_a_rank;
}

}  // namespace fsdp_train::test
