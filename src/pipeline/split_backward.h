#pragma once
// The backward of one stage and microbatch in two parts, as the zero-bubble schedules run it (torch's
// stage_backward_input / stage_backward_weight): I computes only the gradients of the stage's inputs (sent
// upstream at once); W, later, only the weights' — without running the input-gradient chain again.
//
// How: before I, the graph from the stage's output down to its inputs and parameters is walked once. The nodes
// on the input chain that also feed parameters through nodes off the chain ("boundary nodes": a linear's
// AddmmBackward feeds both the previous activation and, through TBackward, its weight) get a pre-hook that keeps
// the gradients reaching them during I. W then starts the engine at each boundary node with those gradients and
// asks only for its parameters, so only the off-chain parts (the dW matmuls) run, and adds the results to .grad.
// When a parameter is reachable from a boundary node also through the input chain (a weight shared by two
// layers of the stage), the split is not exact that way: W then runs the whole backward to the parameters instead
// (correct, slower; fallback_used() says so).
//
// Private to src/pipeline.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace fsdp::pipeline_detail {

class SplitBackward {
 public:
  // `root`: the stage's output (or the last stage's loss); `grad`: its incoming gradient (undefined for a scalar
  // loss); `inputs`: the stage's input leaves that require grad (none on the first stage: I then computes
  // nothing and W runs the whole backward); `params`: the stage's trainable parameters.
  SplitBackward(at::Tensor root, at::Tensor grad, std::vector<at::Tensor> inputs, std::vector<at::Tensor> params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // I: the inputs' gradients (undefined where an input got none). Keeps the graph for W.
  std::vector<at::Tensor> backward_input();
  // W: the parameters' gradients, accumulated into their .grad. Releases the graph.
  void backward_weight();
  bool fallback_used() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::pipeline_detail
