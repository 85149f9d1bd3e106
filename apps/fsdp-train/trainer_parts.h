#pragma once
// The Trainer of fsdp-train (TorchTitan's train.py `Trainer`) and the parts its state is grouped into, for the
// files that implement it, one job each:
//   trainer.cpp             the run: build everything (constructor), the step loop (train), run_training
//   trainer_build.cpp       the build phase: device and threads, model, parallelisation, pipeline, optimizer, peak
//   trainer_step.cpp        one optimizer step: data, forward/backward (or the pipeline), clipping, FT vote, update
//   trainer_validation.cpp  the held-out loss ([validation])
//   trainer_log.cpp         the outputs: the start-up header, the step's metrics line, the run's summary
// Only these files include this header; the rest of fsdp-train sees trainer.h.

#include "checkpoint_seam.h"
#include "data.h"
#include "lr_schedule.h"
#include "metrics_processor.h"
#include "model_spec.h"
#include "moe_balance.h"
#include "profiling.h"
#include "replica_group_ft.h"
#include "trainer.h"
#include "validate.h"

#include <fsdp/pipeline.h>

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_train {

// Sum (or `op`) of a few doubles over the group (identity without a group), on the group's device (NCCL takes CUDA
// tensors only; Gloo on CUDA tensors expects them where its meshes are).
std::vector<double> all_reduce(const fsdp::ProcessGroupPtr& group, std::vector<double> values,
                               fsdp::ReduceOp op = fsdp::ReduceOp::Sum);

// model.attn_mask_type = "block_causal": the tokenizer's EOS, where packed samples split into documents; a
// ConfigError when the tokenizer has none.
int64_t document_eos(const Tokenizer& tokenizer);

// The step's state: the model and what trains it, read and changed by every optimizer step (trainer_step.cpp);
// built once by trainer_build.cpp.
struct StepState {
  ModelShape shape;  // what the model was built with: the tokenizer's vocabulary and EOS, seq_len, device
  TrainModel model;
  ParallelPlan plan;  // how the model was parallelised: meshes, FSDP modules, this rank's pipeline stages
  std::vector<fsdp::models::moe::MoEImpl*> moe_blocks;
  std::vector<bool> moe_held;  // under PP: whether this rank's stages hold moe_blocks[l]
  // The summed token loss of flattened logits (training and validation alike): with loss parallel the logits are
  // sharded over the vocabulary and the cross entropy reduces over the TP group.
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_sum_of;
  std::unique_ptr<fsdp::Pipeline> pipeline;  // under PP: runs this rank's stages by plan.pipeline_schedule
  double pipeline_global_tokens = 1;          // the pipeline loss's divisor (set before each step)
  std::vector<torch::Tensor> params;          // what the optimizer updates (under PP: this rank's stages')
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::optional<LRSchedule> lr_schedule;
  TrainState state;  // the checkpointed counters (step, tokens) and what a checkpoint holds
  // [fault_tolerance]: the batches of a step not yet committed (a step the quorum discards is retried on the same
  // data), and the parameters whose gradients are averaged over the quorum after backward.
  int64_t pending_step = -1;
  std::vector<Batch> pending_batches;
  std::vector<torch::Tensor> ft_after_backward_params;
};

// The run's services: what the loop uses around the step (data, checkpoints, fault tolerance, profiling).
struct RunServices {
  std::shared_ptr<const Tokenizer> tokenizer;
  // model.attn_mask_type = block_causal: the EOS that ends each packed document (nullopt: causal attention).
  std::optional<int64_t> document_eos;
  std::vector<std::string> files;  // the training set's files
  TextOptions text_options;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<Validator> validator;  // [validation]
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<FaultTolerance> ft;  // [fault_tolerance]
  std::unique_ptr<StepProfiler> profiler;
  bool train_timeouts_set = false;  // comm.train_timeout_seconds applied (after the first step)
};

// The outputs: what the run reports (metrics.jsonl, TensorBoard, the console) and returns.
struct RunOutputs {
  TrainSummary summary;
  std::unique_ptr<MetricsProcessor> metrics;
  std::string peak_source;  // where summary.peak_tflops came from (the header says it)
  int64_t first_step = 1;   // the first step this process trains: the log's ETA counts from it
};

// TorchTitan's Trainer: the constructor builds everything (data, model, parallelisation, optimizer, schedule,
// metrics, checkpointer) and restores a checkpoint; train() runs the loop, one train_step() per step, with
// validation, checkpointing and logging as separate steps.
class Trainer {
 public:
  Trainer(const JobConfig& config, const TrainEnv& env);
  ~Trainer();
  TrainSummary train(bool compute_entropy);

 private:
  // What one optimizer step produced (before logging).
  struct StepResult {
    double loss = 0, grad_norm = 0, lr = 0;
    double local_loss_sum = 0;  // this rank's summed token loss (for the max-loss metric)
    int64_t local_tokens = 0;
    double aux_loss = -1;       // MoE sequence-wise balance loss of the step (all ranks); -1 = off
    double data_seconds = 0;
    ExpertLoad expert_load;
    bool committed = true;      // [fault_tolerance]: false = the quorum discarded the step (nothing was applied)
  };

  // ---- build (trainer_build.cpp) ----
  void build_data();
  void build_model();
  void build_pipeline();
  void build_optimizer();
  void build_peak_tflops();
  void build_checkpointer_and_restore();

  // ---- step (trainer_step.cpp) ----
  // `ready`: [fault_tolerance] this rank's state is good for the step (its healing, if any, succeeded).
  StepResult train_step(int64_t step, bool ready = true);
  std::vector<Batch> step_batches(int64_t step);
  // Context parallelism: this rank's chunks of a batch's rows (tokens and labels), of a [B, S] tensor (identity
  // at cp 1).
  Batch context_parallel_chunks(Batch batch) const;
  torch::Tensor context_parallel_chunks(const torch::Tensor& global) const;
  // The step's microbatches through the model (or the pipeline); returns this rank's summed token loss and
  // adds this rank's share of the MoE balance loss to `aux_sum`.
  double forward_backward(std::vector<Batch>& batches, double global_tokens, TrainSummary::TensorMemory& tmem,
                          double& aux_sum);
  double clip_gradients();
  // The document ids the model's forward takes for these tokens (nothing for causal attention).
  torch::Tensor document_ids_of(const torch::Tensor& tokens) const;
  // [fault_tolerance] with MoE: the step's expert counts summed over the quorum's groups before the vote.
  void sum_expert_counts_over_quorum();
  // [fault_tolerance] under fully_shard: the cross-group average as each module's all-reduce hook, but for the
  // blocks that hold an MoE layer (averaged after backward: step_.ft_after_backward_params).
  void attach_fault_tolerance();
  // The groups whose collectives a profiled step times (profiling.h): the world and every group of the meshes.
  std::vector<fsdp::ProcessGroupPtr> profiled_groups() const;
  void set_train_timeouts();

  // ---- validation (trainer_validation.cpp) ----
  void validate(int64_t step);

  // ---- outputs (trainer_log.cpp) ----
  void print_header() const;
  std::string attention_memory_text() const;  // the header's attention memory per rank ("" when unknown)
  void log(int64_t step, const StepResult& r, const TrainSummary::TensorMemory& tmem);
  // The summary train() returns, after the last step.
  void finish_summary(bool compute_entropy);

  // The job: what the run was asked to do, where, fixed at construction.
  const JobConfig& config_;
  const TrainEnv& env_;
  const bool main_rank_, say_;
  const ParallelDims dims_;
  const bool track_tensors_;
  const TrainSpec& spec_;  // model.name's family (model_spec.h)
  const c10::Device device_;  // where this rank's model, batches and loss live (training_device)
  const bool device_memory_;  // the log's memory from the device's caching allocator (device_stats.h)
  const int64_t device_total_bytes_;  // the device's whole memory (0 on the CPU): the log's percentages

  StepState step_;
  RunServices services_;
  RunOutputs outputs_;
};

}  // namespace fsdp_train
