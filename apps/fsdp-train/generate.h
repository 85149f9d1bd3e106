#pragma once
// `fsdp-train generate`: sample text from a trained checkpoint, one process, unsharded model, KV cache.
//
// The checkpoint is a step folder written by the trainer (or its checkpoint folder: the latest complete step),
// saved on any number of ranks: every parameter is read whole from its chunks (fsdp::checkpoint::Reader).
// The model flavor and tokenizer come from the job's configuration: --config, else the config.toml the trainer
// wrote into job.dump_folder (found next to the checkpoint folder), else the embedded default.
// Decoding: the prompt (BOS + its tokens) is run once through the model, filling the cache, then one token at
// a time; temperature 0 = greedy; otherwise logits / temperature, the top_k most likely kept (0 = all), sampled
// with a CPU generator seeded by `seed` (the same seed gives the same text). Stops at EOS or max_new_tokens.

#include "config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_train {

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt;
  int64_t max_new_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 50;
  uint64_t seed = 0;
  bool kv_cache = true;  // false: recompute the whole sequence for every token (tests compare both)
};

struct GenerateResult {
  std::string checkpoint_dir;           // the step folder read
  std::vector<uint32_t> prompt_tokens;  // BOS + prompt
  std::vector<uint32_t> new_tokens;     // sampled (EOS included when it ended the text)
  std::string text;                     // the decoded new tokens (without EOS)
  bool kv_cache = false;                // sampled with a KV cache (asked for, and the family has one)
};

// The step folder `path` names: itself when it holds metadata.json, else its latest complete step-N.
std::string resolve_checkpoint_dir(const std::string& path);
// The config.toml a trainer wrote for the checkpoint at `step_dir` (<dump>/<folder>/step-N -> <dump>/config.toml);
// "" when there is none.
std::string find_job_config(const std::string& step_dir);

GenerateResult generate(const JobConfig& config, const GenerateOptions& options);

// `fsdp-train generate ...` (argument parsing, printing). Returns the exit code.
int generate_main(const std::vector<std::string>& args);

}  // namespace fsdp_train
