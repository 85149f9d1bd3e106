// `fsdp-train generate` on a checkpoint of the default job: the default config trained on 2 ranks under
// fsdprun (as scripts/train.sh does) with checkpoints on, then generation in one process. The text must be
// recognisably the training data's (nearly every byte trigram of it occurs in the license texts; the checkpoint
// after one step writes noise with almost none), greedy decoding must give the same tokens with and without the
// KV cache, and a seed must fix the sampled text.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

std::string run(const std::string& cmd, int* status = nullptr) {
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int rc = pclose(pipe);
  if (status) *status = rc;
  else EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  return out;
}

// Byte trigrams of `generated` after the prompt, and the share of them that occur in the training texts.
double known_trigram_share(const std::string& generated, const std::string& prompt, const std::set<std::string>& corpus,
                           size_t* count) {
  const std::string text = generated.substr(std::min(prompt.size(), generated.size()));
  size_t known = 0, n = 0;
  for (size_t i = 0; i + 3 <= text.size(); ++i, ++n) known += corpus.count(text.substr(i, 3));
  *count = n;
  return n == 0 ? 0.0 : static_cast<double>(known) / static_cast<double>(n);
}

}  // namespace

TEST(Generate, DefaultJobCheckpointWritesLicenseLikeText) {
  const std::string dump = ::testing::TempDir() + "/fsdp_train_generate_job";
  fs::remove_all(dump);
  const std::string train = std::string(FSDPRUN) + " --nproc-per-node 2 " + FSDP_TRAIN +
                            " --checkpoint.enable --checkpoint.enable_first_step_checkpoint --job.dump_folder " + dump +
                            " 2>&1";
  const std::string log = run(train);
  ASSERT_TRUE(fs::exists(dump + "/checkpoint/step-300/metadata.json")) << log;
  ASSERT_TRUE(fs::exists(dump + "/checkpoint/step-1/metadata.json")) << log;
  EXPECT_NE(log.find("validate step:  300"), std::string::npos) << log;  // the default job validates

  // The byte trigrams of the training texts (every license but the held-out one), read independently.
  std::set<std::string> corpus;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses")) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().filename() == "Apache-2.0") continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    for (size_t i = 0; i + 3 <= text.size(); ++i) corpus.insert(text.substr(i, 3));
  }
  ASSERT_GT(corpus.size(), 5000u);

  const std::string prompt = "This program is free software";
  const std::string gen = std::string(FSDP_TRAIN) + " generate --prompt '" + prompt + "' ";
  const std::string ckpt = "--checkpoint " + dump + "/checkpoint ";
  // Greedy: the trained checkpoint (saved on 2 ranks, read by 1 process) writes license-like text.
  const std::string greedy = run(gen + ckpt + "--temperature 0 --max_new_tokens 300 2>/dev/null");
  size_t n = 0;
  const double share = known_trigram_share(greedy, prompt, corpus, &n);
  std::cout << "greedy: " << greedy << "known trigrams " << share << " of " << n << "\n";
  EXPECT_EQ(greedy.rfind(prompt, 0), 0u);
  EXPECT_GE(n, 100u) << greedy;
  EXPECT_GE(share, 0.85) << greedy;
  // The KV cache changes nothing in greedy decoding (80 tokens: without the cache it is quadratic).
  EXPECT_EQ(run(gen + ckpt + "--temperature 0 --max_new_tokens 80 --no_kv_cache 2>/dev/null"),
            run(gen + ckpt + "--temperature 0 --max_new_tokens 80 2>/dev/null"));
  // Sampling: the same seed gives the same text, another seed another text; still license-like.
  const std::string sample = gen + ckpt + "--temperature 0.8 --top_k 20 --max_new_tokens 200 ";
  const std::string s1 = run(sample + "--seed 1 2>/dev/null"), s1b = run(sample + "--seed 1 2>/dev/null");
  const std::string s2 = run(sample + "--seed 2 2>/dev/null");
  std::cout << "sampled (seed 1): " << s1;
  EXPECT_EQ(s1, s1b);
  EXPECT_NE(s1, s2);
  EXPECT_GE(known_trigram_share(s1, prompt, corpus, &n), 0.85) << s1;
  EXPECT_GE(known_trigram_share(s2, prompt, corpus, &n), 0.85) << s2;
  // The reference moved: after one step the model writes noise, not license text.
  const std::string early = run(gen + "--checkpoint " + dump +
                                "/checkpoint/step-1 --temperature 0.8 --top_k 20 --max_new_tokens 300 --seed 1 2>/dev/null");
  const double early_share = known_trigram_share(early, prompt, corpus, &n);
  std::cout << "after 1 step: known trigrams " << early_share << " of " << n << "\n";
  EXPECT_LT(early_share, 0.3) << early;
  // Bad input: a clear error naming the problem.
  int rc = 0;
  const std::string missing = run(std::string(FSDP_TRAIN) + " generate --prompt x --checkpoint " + dump + "/nope 2>&1", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(missing.find("does not exist"), std::string::npos) << missing;
  const std::string wrong = run(gen + ckpt + "--model.flavor cpu_tiny 2>&1", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(wrong.find("has shape"), std::string::npos) << wrong;
}

// A family without a KV cache (deepseek_v3: MLA's latent cache is not written): generate re-runs the whole sequence
// per token, says so instead of claiming a cache, and --no_kv_cache gives the same greedy text. The checkpoint is a
// few steps of deepseek_v3 cpu_tiny on 1 rank.
TEST(Generate, DeepSeekV3HasNoKvCacheAndSaysSo) {
  const std::string dump = ::testing::TempDir() + "/fsdp_train_generate_deepseek_v3";
  fs::remove_all(dump);
  const std::string log =
      run(std::string(FSDP_TRAIN) + " --model.name deepseek_v3 --model.flavor cpu_tiny --training.steps 4" +
          " --training.seq_len 64 --metrics.log_freq 1 --validation.enable false --checkpoint.enable" +
          " --checkpoint.interval 4 --job.dump_folder " + dump + " 2>&1");
  ASSERT_TRUE(fs::exists(dump + "/checkpoint/step-4/metadata.json")) << log;
  const std::string gen = std::string(FSDP_TRAIN) + " generate --prompt 'This program' --checkpoint " + dump +
                          "/checkpoint --temperature 0 --max_new_tokens 12 ";
  const std::string with = run(gen + "2>&1");
  EXPECT_NE(with.find("generate: deepseek_v3 cpu_tiny"), std::string::npos) << with;
  EXPECT_NE(with.find("no KV cache: the model has none"), std::string::npos) << with;
  EXPECT_EQ(with.find(", KV cache)"), std::string::npos) << with;
  EXPECT_EQ(run(gen + "2>/dev/null"), run(gen + "--no_kv_cache 2>/dev/null"));
  const std::string without = run(gen + "--no_kv_cache 2>&1");
  EXPECT_NE(without.find(", no KV cache)"), std::string::npos) << without;
  fs::remove_all(dump);
}
