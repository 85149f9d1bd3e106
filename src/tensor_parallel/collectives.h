#pragma once
// The collectives that tensor-parallel layouts imply, as autograd functions over the TP group: each pairs a
// forward collective with the backward one that DTensor's redistribution would run for the gradient's
// placement (Megatron's f/g operators). Activations only: dims that are split or gathered must divide by
// the group size unless `full_size` says otherwise (then chunks follow torch.chunk, zero-padded on the wire).

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdp::tp {

// Partial -> Replicate (rowwise output): all-reduce (sum) | identity.
at::Tensor all_reduce_forward(const at::Tensor& x, const ProcessGroupPtr& group);
// Replicate input of a colwise layer whose gradient comes back Partial: identity | all-reduce (sum).
at::Tensor all_reduce_backward(const at::Tensor& x, const ProcessGroupPtr& group);
// Shard(dim) -> Replicate, gradient Partial (inputs of colwise layers, PrepareModuleInput):
// all-gather | reduce-scatter (sum). `full_size` = the gathered length of `dim` (-1: local * group size).
at::Tensor gather_for_partial_grad(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                   int64_t full_size = -1);
// Shard(dim) -> Replicate, gradient Replicate (colwise output gathered): all-gather | local chunk.
at::Tensor gather_for_replicate_grad(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                     int64_t full_size = -1);
// Partial -> Shard(dim) (rowwise output, sequence parallel): reduce-scatter (sum) | all-gather.
at::Tensor reduce_scatter_forward(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim);
// Replicate -> Shard(dim): local chunk | all-gather.
at::Tensor chunk_forward(const at::Tensor& x, const ProcessGroupPtr& group, int64_t dim);

// A Replicate parameter whose use makes its gradient Partial over the TP ranks (it meets a sharded activation,
// e.g. a sequence-parallel norm's weight): a hook sums the gradient over `group` before it is accumulated
// (DTensor's Partial -> Replicate), one all-reduce per parameter per backward.
void all_reduce_grad_over_tp(at::Tensor& param, const ProcessGroupPtr& group);

// True when `x` is the output of gather_for_partial_grad (so its gradient is already reduced in backward:
// a colwise layer reading it directly must not all-reduce its input gradient again).
bool produced_by_partial_grad_gather(const at::Tensor& x);

}  // namespace fsdp::tp
