// The Trainer's validation (trainer_parts.h): the held-out loss of [validation], through the model or the
// pipeline's forward-only schedule, each cp rank on its chunks of the rows.
#include "trainer_parts.h"

#include <torch/torch.h>

namespace fsdp_train {

void Trainer::validate(int64_t step) {
  Validator::BatchLoss batch_loss;
  if (step_.pipeline) {
    // The forward-only schedule: the last stage's ranks get each microbatch's loss (here: the summed token loss,
    // step_.pipeline_global_tokens = 1).
    // Under CP each rank its chunks of the rows, and of their document ids.
    batch_loss = [this](const torch::Tensor& x, const torch::Tensor& y) {
      step_.pipeline_global_tokens = 1;
      const TrainModel& model = step_.model;
      const torch::Tensor xd = context_parallel_chunks(x).to(device_);
      const torch::Tensor ids = model.document_ids ? context_parallel_chunks(model.document_ids(x)).to(device_)
                                                   : torch::Tensor();
      return step_.pipeline
          ->eval(step_.plan.holds_first_stage ? xd : torch::Tensor(),
                 step_.plan.holds_last_stage ? context_parallel_chunks(y).to(device_) : torch::Tensor(), ids)
          .loss_sum();
    };
  } else {
    batch_loss = [this](const torch::Tensor& x, const torch::Tensor& y) {
      // Context parallelism: each cp rank its chunks of the rows (block_causal: and of the rows' document ids);
      // the losses add up over the cp ranks.
      const TrainModel& model = step_.model;
      const torch::Tensor xd = context_parallel_chunks(x).to(device_);
      auto logits = dims_.cp > 1 && model.document_ids
                        ? model.forward_with_document_ids(xd, context_parallel_chunks(model.document_ids(x)).to(device_))
                        : model.forward(xd);
      return step_
          .loss_sum_of(logits.reshape({-1, logits.size(-1)}), context_parallel_chunks(y).to(device_).reshape({-1}))
          .item<double>();
    };
  }
  // Each cp rank counts its data-parallel rank's whole batch (it is given the full rows).
  const ValidationResult v =
      services_.validator->validate(batch_loss, env_.group, dims_.tp, dims_.tp * dims_.pp * dims_.cp);
  outputs_.summary.validation_steps.push_back(step);
  outputs_.summary.validation_losses.push_back(v.loss);
  outputs_.metrics->log_validation(step, v.loss, v.perplexity, v.tokens, v.tps, v.seconds);
}

}  // namespace fsdp_train
