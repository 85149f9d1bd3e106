// Validation (see validate.h).
#include "validate.h"

#include "data.h"

#include <fsdp/nn/module_call.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <stdexcept>

namespace fsdp_train {

Validator::Validator(const JobConfig::Validation& config, std::shared_ptr<const Tokenizer> tokenizer,
                     int64_t vocab_limit, int64_t dp_rank, int64_t dp_degree, const TextOptions& text)
    : config_(config), dp_rank_(dp_rank), dp_degree_(dp_degree) {
  files_ = resolve_dataset_files(config.dataset, config.dataset_path, "validation");
  tokens_ = read_one_epoch(files_, std::move(tokenizer), vocab_limit, text, &bad_records_);
  num_samples_ = static_cast<int64_t>(tokens_.size()) / (config.seq_len + 1);
  if (num_samples_ == 0)
    throw std::runtime_error("validation: the held-out stream (" + std::string(to_string(config.dataset)) + ", " +
                             std::to_string(tokens_.size()) + " tokens) is shorter than one sample of validation.seq_len + 1 = " +
                             std::to_string(config.seq_len + 1) + " tokens");
}

int64_t Validator::batches_per_run() const {
  if (config_.steps > 0) return config_.steps;
  const int64_t per_batch = config_.local_batch_size * dp_degree_;
  return (num_samples_ + per_batch - 1) / per_batch;
}

ValidationResult Validator::validate(const BatchLoss& batch_loss, const fsdp::ProcessGroupPtr& group,
                                     int64_t loss_copies, int64_t token_copies) const {
  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const int64_t L = config_.local_batch_size, S = config_.seq_len, batches = batches_per_run();
  double loss_sum = 0, valid = 0;
  std::vector<int64_t> inputs(static_cast<size_t>(L * S)), labels(static_cast<size_t>(L * S));
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t row = 0; row < L; ++row) {
      int64_t sample = (b * dp_degree_ + dp_rank_) * L + row;
      int64_t* in = inputs.data() + row * S;
      int64_t* lab = labels.data() + row * S;
      if (config_.steps > 0) sample %= num_samples_;  // a bounded run wraps around the stream
      if (sample >= num_samples_) {                   // padding of the last full-pass batch: nothing counted
        std::fill(in, in + S, 0);
        std::fill(lab, lab + S, -100);
        continue;
      }
      const int64_t* src = tokens_.data() + sample * (S + 1);
      std::copy(src, src + S, in);
      std::copy(src + 1, src + S + 1, lab);
    }
    auto x = torch::from_blob(inputs.data(), {L, S}, torch::kLong);
    auto y = torch::from_blob(labels.data(), {L, S}, torch::kLong);
    loss_sum += batch_loss(x, y);
    valid += static_cast<double>(y.ne(-100).sum().item<int64_t>());
  }
  double totals[2] = {loss_sum, valid};
  if (group) {
    auto t = torch::tensor({loss_sum, valid}, torch::kDouble).to(group->device());  // NCCL: CUDA tensors only
    group->all_reduce(t, fsdp::ReduceOp::Sum).wait();
    t = t.cpu();
    totals[0] = t[0].item<double>() / static_cast<double>(loss_copies);
    totals[1] = t[1].item<double>() / static_cast<double>(token_copies);
  }
  ValidationResult r;
  r.tokens = static_cast<int64_t>(totals[1]);
  r.loss = totals[1] > 0 ? totals[0] / totals[1] : std::nan("");
  r.perplexity = std::exp(r.loss);
  r.batches = batches;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tps = static_cast<double>(batches * L * S) / r.seconds;
  return r;
}

}  // namespace fsdp_train
