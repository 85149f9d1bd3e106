#pragma once
// Validation (TorchTitan's Validator): every validation.freq steps (and at step 1) the model runs forward under
// no_grad over a held-out token stream on every data-parallel rank; the loss is the sum of token losses over all
// ranks divided by the global count of valid tokens, so it does not depend on how the samples were spread.
//
// The held-out stream (one epoch of validation.dataset, read into memory once: held-out sets are small) is cut
// into samples of seq_len + 1 tokens like the training stream. Validation batch k covers samples
// [k*L*D, (k+1)*L*D) (L = validation.local_batch_size, D = data-parallel degree), rank r taking rows
// [r*L, (r+1)*L). steps = -1 evaluates every complete sample exactly once: the last batch is padded with rows
// whose labels are all ignored, so every rank runs the same number of forwards (FSDP's all-gathers need it) and
// the result is the same for any D and L. steps = N evaluates N batches, wrapping around the stream.
// Nothing of the training state is touched: no gradients, no RNG draws, no data-loader position.

#include "config.h"
#include "data.h"
#include "tokenizer.h"

#include <fsdp/process_group.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace fsdp_train {

struct ValidationResult {
  double loss = 0;        // nats per valid token over all ranks
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // valid tokens evaluated, all ranks
  int64_t batches = 0;    // forwards per rank
  double seconds = 0;
  double tps = 0;         // evaluated tokens per second per rank
};

class Validator {
 public:
  Validator(const JobConfig::Validation& config, std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_limit,
            int64_t dp_rank, int64_t dp_degree, const TextOptions& text = {});
  int64_t bad_records() const { return bad_records_; }
  bool should_validate(int64_t step) const { return step == 1 || step % config_.freq == 0; }
  // One held-out batch through the model: inputs [L, S] and labels [L, S] (-100 = not counted) -> this rank's
  // summed token loss, 0 on a rank that computes none (a pipeline stage other than the last). The trainer runs
  // its own model here (fsdp::nn::call, or the pipeline's forward-only schedule), with its own loss, so tensor
  // parallel's vocabulary-sharded logits get the loss-parallel cross entropy too.
  using BatchLoss = std::function<double(const at::Tensor& inputs, const at::Tensor& labels)>;
  // Collective over `group` (null: one process). Copies: how many ranks of the group hold each data-parallel
  // rank's summed loss (its tp ranks: tp) and its tokens (its tp and pp ranks: tp x pp); the totals count each
  // once.
  ValidationResult validate(const BatchLoss& batch_loss, const fsdp::ProcessGroupPtr& group, int64_t loss_copies = 1,
                            int64_t token_copies = 1) const;
  int64_t num_samples() const { return num_samples_; }
  int64_t batches_per_run() const;
  const std::vector<std::string>& files() const { return files_; }

 private:
  JobConfig::Validation config_;
  int64_t dp_rank_, dp_degree_;
  std::vector<std::string> files_;
  std::vector<int64_t> tokens_;  // one epoch of the held-out stream
  int64_t num_samples_ = 0;      // complete samples of seq_len + 1 tokens in it
  int64_t bad_records_ = 0;      // JSON Lines records skipped while reading it
};

}  // namespace fsdp_train
