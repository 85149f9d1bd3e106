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
namespace fsdp::nn::llama {
class TransformerImpl;
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
  // Summed token loss of flattened logits [N, V] against labels [N] (ignore index -100): the training loop's own
  // loss, so tensor parallel's vocabulary-sharded logits get the loss-parallel cross entropy here too.
  using LossSum = std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& labels)>;
  // Collective over `group` (null: one process). `model` is the root module the training loop calls.
  // `tp_degree`: the tensor-parallel ranks of one data-parallel rank hold the same samples and the same summed
  // loss, so the group totals count each of them tp_degree times.
  ValidationResult validate(fsdp::nn::llama::TransformerImpl& model, const fsdp::ProcessGroupPtr& group,
                            const LossSum& loss_sum, int64_t tp_degree = 1) const;
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
