// fsdp-train with model.attn_mask_type = "block_causal" (TorchTitan's document masking), on a JSON Lines corpus of
// short documents so that every packed sample holds several of them.
//  - One rank: the loss and grad norm of step 1 equal an independent reference built here — the step's 8 samples
//    cut from the token stream written out by hand (BOS, bytes, EOS per document), each sample split after every
//    EOS and each document run alone through a plain causal model with the trainer's initial weights (summed token
//    losses over the step's tokens). The same reference without splitting equals the causal run (so the batch was
//    rebuilt right), and the two differ (the mask ran).
//  - Two ranks (fsdprun): FSDP (dp_shard 2), FSDP with full activation checkpointing, TP 2 and PP 2 runs with
//    block_causal equal the 1-rank run on the same global batches (loss and grad norm of every step, validation);
//    so does Qwen3-MoE (cpu_tiny_moe) with expert parallelism 2.
//  - An unknown attn_mask_type, and block_causal with a tokenizer without EOS, are refused naming the key.
#include "config.h"
#include "tokenizer.h"
#include "train_env.h"
#include "trainer.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>  // model_flavor
#include <fsdp/process_group.h>

#include "comm/dist_env.h"
#include "expect_error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <algorithm>
#include <cmath>
#include <functional>
#include <fstream>
#include <random>

using namespace fsdp_train;

namespace {

constexpr int64_t kSeq = 32, kGlobalBatch = 8;

// 400 documents of 3-16 lowercase letters and spaces (deterministic: the same on every rank).
std::vector<std::string> documents() {
  std::mt19937 gen(5);
  std::vector<std::string> docs;
  const std::string letters = "abcdefghij klmnopqrst";
  for (int i = 0; i < 400; ++i) {
    std::string d(3 + gen() % 14, ' ');
    for (auto& ch : d) ch = letters[gen() % letters.size()];
    docs.push_back(d);
  }
  return docs;
}

// The corpus file, written once by rank 0 into a folder every rank names the same. Collective.
std::string corpus() {
  static std::string path;
  if (!path.empty()) return path;
  const std::string dir = test::shared_dir("fsdp_train_block_causal", "data");
  path = dir + "/docs.jsonl";
  if (fsdp::world()->rank() == 0) {
    std::filesystem::create_directories(dir);
    std::ofstream out(path);
    for (const auto& d : documents()) out << "{\"text\": \"" << d << "\"}\n";
  }
  fsdp::world()->barrier().wait();
  return path;
}

JobConfig base(const std::string& name, const std::string& mask = "block_causal", int64_t steps = 4) {
  JobConfig c = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", std::to_string(kSeq),
                             "--training.local_batch_size", "2", "--training.global_batch_size",
                             std::to_string(kGlobalBatch), "--training.steps", std::to_string(steps),
                             "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1", "--training.dataset",
                             "jsonl", "--training.dataset_path", corpus(), "--model.attn_mask_type", mask});
  c.validation.enable = true;
  c.validation.dataset = Dataset::Jsonl;
  c.validation.dataset_path = corpus();
  c.validation.freq = 2;
  c.validation.steps = 2;
  c.validation.local_batch_size = 4;
  c.validation.seq_len = kSeq;
  // References (every process runs its own) get a folder each; distributed runs share one.
  const bool per_rank = name.rfind("ref", 0) == 0;
  c.job.dump_folder = per_rank ? ::testing::TempDir() + "/fsdp_train_block_causal_" + name + "_rank" +
                                     std::to_string(fsdp::world()->rank()) + "_" + std::to_string(::getppid())
                               : test::shared_dir("fsdp_train_block_causal", name);
  if (per_rank) std::filesystem::remove_all(c.job.dump_folder);
  return c;
}

TrainSummary run_single(const JobConfig& c) {
  TrainEnv single;
  single.verbose = false;
  return run_training(c, single, false);
}

// Step 1's samples, cut from the stream written out here: each document is BOS (256), its bytes, EOS (257);
// sample k is tokens [k (S + 1), (k + 1) (S + 1)).
std::vector<int64_t> step_one_stream() {
  std::vector<int64_t> stream;
  for (const auto& d : documents()) {
    stream.push_back(256);
    for (unsigned char ch : d) stream.push_back(ch);
    stream.push_back(257);
    if (static_cast<int64_t>(stream.size()) >= kGlobalBatch * (kSeq + 1)) break;
  }
  stream.resize(kGlobalBatch * (kSeq + 1));
  return stream;
}

struct Reference {
  double loss, grad_norm;
  int64_t documents;
};

// Step 1's loss and gradient norm computed from the stream with a plain causal model; split_documents: each sample
// cut after every EOS and each piece run alone.
Reference reference_step_one(const JobConfig& config, bool split_documents) {
  auto args = fsdp::models::llama::model_flavor("llama3", "cpu_tiny");
  args.vocab_size = 258;  // the byte-level tokenizer's
  fsdp::models::llama::Transformer model(args);
  model->init_weights(static_cast<uint64_t>(config.debug.seed));
  auto rows = torch::tensor(step_one_stream()).view({kGlobalBatch, kSeq + 1});
  auto ce = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  };
  torch::Tensor total = torch::zeros({});
  Reference r{0, 0, 0};
  for (int64_t b = 0; b < kGlobalBatch; ++b) {
    auto inputs = rows[b].slice(0, 0, kSeq), labels = rows[b].slice(0, 1, kSeq + 1);
    int64_t start = 0;
    for (int64_t t = 0; t < kSeq; ++t) {
      const bool cut = split_documents && inputs[t].item<int64_t>() == 257;
      if (!cut && t + 1 < kSeq) continue;
      total = total + ce(model(inputs.slice(0, start, t + 1).unsqueeze(0)), labels.slice(0, start, t + 1).unsqueeze(0));
      ++r.documents;
      start = t + 1;
    }
  }
  total = total / static_cast<double>(kGlobalBatch * kSeq);
  total.backward();
  double sq = 0;
  for (const auto& p : model->parameters()) sq += p.grad().pow(2).sum().item<double>();
  r.loss = total.item<double>();
  r.grad_norm = std::sqrt(sq);
  return r;
}

}  // namespace

TEST(BlockCausalTrainer, StepOneEqualsDocumentsAlone) {
  const JobConfig packed_config = base("ref_block_causal_1", "block_causal", /*steps=*/1);
  const TrainSummary packed = run_single(packed_config);
  const TrainSummary across = run_single(base("ref_causal_1", "causal", /*steps=*/1));
  ASSERT_EQ(packed.losses.size(), 1u);
  ASSERT_EQ(across.losses.size(), 1u);

  const Reference whole = reference_step_one(packed_config, /*split_documents=*/false);
  const Reference alone = reference_step_one(packed_config, /*split_documents=*/true);
  EXPECT_GE(alone.documents, 3 * kGlobalBatch) << "the samples must hold several documents each";
  const double agreement = std::abs(packed.losses[0] - alone.loss);
  // The batch rebuilt here is the trainer's: the causal run equals the unsplit reference.
  EXPECT_NEAR(across.losses[0], whole.loss, 1e-5 * whole.loss);
  EXPECT_NEAR(across.grad_norms[0], whole.grad_norm, 1e-5 * whole.grad_norm);
  // block_causal = the documents run one by one.
  EXPECT_NEAR(packed.losses[0], alone.loss, 1e-5 * alone.loss);
  EXPECT_NEAR(packed.grad_norms[0], alone.grad_norm, 1e-5 * alone.grad_norm);
  // The mask ran: attending across documents gives another loss, by 100 times more than the packed run and the
  // reference differ (or than float32's 1e-7, if they agree better). An untrained model uses little context, so
  // the difference is small, but far above the arithmetic's.
  EXPECT_GT(std::abs(across.losses[0] - packed.losses[0]), 100 * std::max(agreement, 1e-7 * alone.loss))
      << "causal " << across.losses[0] << " block_causal " << packed.losses[0] << " reference " << alone.loss;
}

namespace {

struct Layout {
  const char* name;
  std::function<void(JobConfig&)> apply;
  const char* plan;  // what the run's plan description must say
};

// Each layout (2 ranks) against the 1-rank run of `model` (applied to both) on the same global batches.
void expect_layouts_equal_one_rank(const std::function<void(JobConfig&)>& model, const std::vector<Layout>& layouts) {
  JobConfig ref_config = base("ref_layouts");
  model(ref_config);
  const TrainSummary ref = run_single(ref_config);
  ASSERT_EQ(ref.validation_steps, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (const auto& l : layouts) {
    SCOPED_TRACE(l.name);
    JobConfig config = base(l.name);
    model(config);
    l.apply(config);
    if (config.parallelism.data_parallel_shard_degree == 2) config.validation.steps = 1;  // the same held-out samples
    const TrainSummary got = run_training(config, test::world_env(), false);
    EXPECT_NE(got.plan.find(l.plan), std::string::npos) << got.plan;
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
      EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * ref.grad_norms[i]) << "step " << i + 1;
    }
    ASSERT_EQ(got.validation_steps, ref.validation_steps);
    for (size_t i = 0; i < ref.validation_losses.size(); ++i)
      EXPECT_NEAR(got.validation_losses[i], ref.validation_losses[i], 1e-5 * ref.validation_losses[i]) << "validation " << i;
  }
}

}  // namespace

TEST(BlockCausalTrainer, LayoutsEqualOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  expect_layouts_equal_one_rank(
      [](JobConfig&) {},  // llama3 cpu_tiny
      {
          {"dp2", [](JobConfig& c) { c.parallelism.data_parallel_shard_degree = 2; }, "FSDP"},
          {"dp2_ac",
           [](JobConfig& c) {
             c.parallelism.data_parallel_shard_degree = 2;
             c.activation_checkpoint.mode = AcMode::Full;
           },
           "full activation checkpointing"},
          {"tp2", [](JobConfig& c) { c.parallelism.tensor_parallel_degree = 2; }, "TP 2"},
          {"pp2",
           [](JobConfig& c) {
             c.parallelism.pipeline_parallel_degree = 2;
             c.training.local_batch_size = 4;  // 4 microbatches of 1
             c.parallelism.pipeline_parallel_microbatch_size = 1;
           },
           "PP 2 ("},
      });
}

TEST(BlockCausalTrainer, MoeExpertParallelEqualsOneRank) {
  if (fsdp::world()->size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  expect_layouts_equal_one_rank(
      [](JobConfig& c) {
        c.model.name = "qwen3";
        c.model.flavor = "cpu_tiny_moe";
      },
      {{"moe_ep2",
        [](JobConfig& c) {
          c.parallelism.data_parallel_shard_degree = 2;
          c.parallelism.expert_parallel_degree = 2;
        },
        "EP 2 ("}});
}

// block_causal splits at the tokenizer's EOS: a tokenizer.json without one is refused before training, naming the key.
TEST(BlockCausalTrainer, TokenizerWithoutEosRefused) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_to_unicode()[b]] = b;
  const nlohmann::json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
  };
  const std::string path = ::testing::TempDir() + "/block_causal_no_eos_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << tokenizer.dump();
  JobConfig config = base("ref_no_eos", "block_causal", /*steps=*/1);
  config.model.tokenizer_path = path;
  const std::string message = fsdp_test::error_of([&] { run_single(config); });
  fsdp_test::expect_message_has(message, {"model.attn_mask_type", "block_causal", "no EOS token"});
  config.model.attn_mask_type = AttnMaskType::Causal;  // the same tokenizer trains causally
  EXPECT_EQ(run_single(config).losses.size(), 1u);
  std::filesystem::remove(path);
}

TEST(BlockCausalTrainer, UnknownMaskTypeRefusedNamingTheKey) {
  const std::string message = fsdp_test::error_of([] { load_config({"--model.attn_mask_type", "sliding_window"}); });
  fsdp_test::expect_message_has(message, {"model.attn_mask_type", "sliding_window", "block_causal"});
  const std::string file = ::testing::TempDir() + "/block_causal_bad_" + std::to_string(::getpid()) + ".toml";
  std::ofstream(file) << "[model]\nattn_mask_type = \"document\"\n";
  const std::string from_file = fsdp_test::error_of([&] { load_config({"--config", file}); });
  fsdp_test::expect_message_has(from_file, {"attn_mask_type", "document", "block_causal", ":2:"});
  std::filesystem::remove(file);
}
