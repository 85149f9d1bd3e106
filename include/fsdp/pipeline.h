#pragma once
// Pipeline parallelism (torch.distributed.pipelining's runtime, in C++): the model is cut into stages; each
// rank of a pipeline group holds one or more of them (its model parts) and a step pushes microbatches through
// them by a schedule — GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV,
// or one read from a CSV file — executed
// from the schedule's action list (fsdp/pipeline/schedule.h: build, print, validate, simulate). Activations go
// forward and their gradients back between neighbouring stages with point-to-point transfers over the pipeline
// group; shapes are agreed at the first step.
//
// Composed with fully_shard (docs/pipeline.md): a stage module given to fully_shard is all-gathered once per step
// (UNSHARD), kept unsharded across its microbatches, and each of its groups reduce-scatters once per step after
// its last microbatch's backward (REDUCE_GRAD), whatever the number of microbatches. Apply fully_shard with
// reshard_after_forward = false to the stage's modules (TorchTitan's choice under PP).

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

// One stage this rank holds: its part of the model and the function that runs it on one microbatch (call the
// module through fsdp::nn::call so that FSDP's and checkpointing's hooks run). The first stage gets the step's
// inputs (any dtype, e.g. token ids), the others the previous stage's output; the last stage's output goes to
// the loss function.
struct PipelineStage {
  int index = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor& input)> forward;
  // Instead of `forward`, for a stage that needs more than its input: also given the microbatch's slice of the
  // step's `context` (step()/eval()'s third argument, split along dim 0 as the inputs are; undefined when the step
  // has none). Every stage gets it, as torch's schedules give every stage the step's kwargs (TorchTitan passes
  // its attention masks so).
  std::function<at::Tensor(const at::Tensor& input, const at::Tensor& context)> forward_with_context;
};

// The loss of one microbatch: its last-stage output and its targets. It is backpropagated as is (no division by
// the number of microbatches, as TorchTitan's scale_grads=False): return the microbatch's share of the step's
// loss (e.g. its summed token loss divided by the global number of tokens, or its mean divided by the number of
// microbatches) so that the sum over microbatches is the step's loss.
using PipelineLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct PipelineOptions {
  std::string schedule = "1F1B";  // torch / TorchTitan names, case-insensitive
  int microbatches = 1;           // the step's inputs are split into this many equal pieces along dim 0
  int num_stages = 0;             // 0 = pipeline group size x the schedule's stages per rank (2 for a CSV)
  // A compute-only schedule file instead of a named schedule (torch's _load_csv; fsdp/pipeline/schedule.h:
  // load_schedule_csv). Its stage placement is the file's; `schedule` is then ignored.
  std::string schedule_csv;
};

// What one action of the last step did on this rank (for the measured bubble, docs/pipeline.md).
struct PipelineActionSpan {
  std::string action;  // torch's action string: "1F3", "0SEND_F2", "2REDUCE_GRAD", ...
  std::chrono::steady_clock::time_point start, end;
};

struct PipelineStepResult {
  // The losses of the microbatches, in order, detached; empty on ranks without the last stage.
  std::vector<at::Tensor> losses;
  bool has_loss() const { return !losses.empty(); }
  double loss_sum() const;  // 0 without the last stage
};

namespace pipeline {
struct PipelineSchedule;
}

class Pipeline {
 public:
  // `stages`: the stages this rank holds (exactly those the schedule assigns to this rank of `group`, in any
  // order). Checks the schedule against the group and the options; an error names what is wrong.
  Pipeline(std::vector<PipelineStage> stages, ProcessGroupPtr group, PipelineLoss loss, PipelineOptions options);
  // The same with the schedule built beforehand (fsdp/pipeline/schedule.h: build_schedule, load_schedule_csv), for
  // a caller that placed its stages by it (TorchTitan builds the schedule once, from the stages it split): it is
  // not built again, and the stages run by the schedule that placed them. The step's microbatches are the
  // schedule's; its pipeline ranks must be the group's size.
  Pipeline(std::vector<PipelineStage> stages, ProcessGroupPtr group, PipelineLoss loss,
           pipeline::PipelineSchedule schedule);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One training step: forward and backward of every microbatch, gradients accumulated on the stages'
  // parameters (and reduced once by fully_shard). `inputs` is used on the rank of the first stage, `targets`
  // on the rank of the last (pass undefined tensors elsewhere). Every rank of the group calls it.
  // `context` (optional, on any rank that passes it): split into microbatches like `inputs` and handed to the
  // stages' forward_with_context.
  PipelineStepResult step(const at::Tensor& inputs, const at::Tensor& targets, const at::Tensor& context = {});
  // Forward only (validation): the microbatches' losses on the last stage's rank, no gradients. Its batch may
  // have another shape than training's (shapes are agreed anew for each call); it must split into the same
  // number of microbatches.
  PipelineStepResult eval(const at::Tensor& inputs, const at::Tensor& targets, const at::Tensor& context = {});

  const pipeline::PipelineSchedule& schedule() const;
  // The schedule as a grid, one column per rank (with_comms: the lowered list this runtime executes).
  std::string describe(bool with_comms) const;
  // The actions of the last step on this rank, in the order they ran.
  const std::vector<PipelineActionSpan>& last_step_timeline() const;
  // The stages this rank holds, by index.
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
