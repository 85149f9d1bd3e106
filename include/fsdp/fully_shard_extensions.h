#pragma once
// FSDP2's extension points for fully_shard's communication:
//
// * Custom collectives (PyTorch's FSDPModule.set_custom_all_gather / set_custom_reduce_scatter): a user object
//   allocates the buffer a group's all-gather (or reduce-scatter) writes into and runs the collective — e.g. to
//   place the buffer in registered / symmetric memory, or to run the collective on another communicator.
//   Set on one module's group: FSDPModule::set_custom_all_gather(std::make_shared<MyAllGather>()).
// * A per-parameter all-gather transform (PyTorch's fsdp_pre_all_gather / fsdp_post_all_gather on a tensor
//   subclass): the parameter says what to send instead of its shard and how to rebuild the full parameter from
//   what arrives. Chosen per parameter at fully_shard (FullyShardOptions::all_gather_transform_fn).
//   Int8RowwiseAllGather is a real one: ZeRO++'s quantized weights, a frozen base all-gathered as int8 with one
//   fp32 scale per row (about 1/4 of the fp32 bytes) and dequantized after.

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace fsdp {

// The all-gather of one FSDP parameter group. Its buffers are flat uint8 tensors: every rank's slot holds the
// group's parameters packed (the same layout on every rank).
class FSDPAllGather {
 public:
  virtual ~FSDPAllGather() = default;
  // The output buffer: `numel` elements of `dtype` on `device` (called on the stream the all-gather's copy-in
  // runs on).
  virtual at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) = 0;
  // Gathers every rank's `input` into `output` (rank-major; `input` may be `output`'s own slot). Asynchronous:
  // FSDP waits on the returned Work before it reads `output`.
  virtual Work operator()(at::Tensor output, at::Tensor input, ProcessGroup& group) = 0;
};

// The reduce-scatter of one group's gradients: `input` holds every rank's slot, rank r receives `op` over the
// ranks' slot r in `output`.
class FSDPReduceScatter {
 public:
  virtual ~FSDPReduceScatter() = default;
  virtual at::Tensor allocate(int64_t numel, c10::ScalarType dtype, c10::Device device) = 0;
  virtual Work operator()(at::Tensor output, at::Tensor input, ProcessGroup& group, ReduceOp op) = 0;
};

// What one parameter sends in the all-gather, and how its full value is rebuilt. Parameters sharded on dim 0
// only. FSDP calls pre_all_gather with this rank's zero-padded shard [chunk_rows, ...] in the parameter's
// original dtype; each returned tensor must have the shape and dtype input_specs() announced for that shard
// shape (the group's buffer layout is fixed from them). After the all-gather, post_all_gather receives every
// input gathered rank-major and flattened: [world * chunk_rows, ...]; the parameter's real rows are the first
// ones (torch.chunk sharding), so it returns a tensor whose first rows are the parameter in `param_dtype` (more
// rows, the padding, are ignored). Gradients are not transformed: autograd sees the rebuilt parameter, and its
// gradient is reduced as usual.
class AllGatherTransform {
 public:
  struct TensorSpec {
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
  };
  virtual ~AllGatherTransform() = default;
  virtual std::vector<TensorSpec> input_specs(c10::IntArrayRef padded_shard_sizes,
                                              c10::ScalarType shard_dtype) const = 0;
  virtual std::vector<at::Tensor> pre_all_gather(const at::Tensor& padded_shard) const = 0;
  virtual at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered, c10::ScalarType param_dtype) const = 0;
};

// ZeRO++'s quantized weight all-gather: each row r of a 2-D (or higher) parameter becomes int8 values
// q = round(w / s_r) in [-127, 127] with s_r = max|w_r| / 127 (s_r = 1 for an all-zero row), sent with s_r as
// fp32, and is rebuilt as q * s_r. Per-row scales make the result independent of how rows are split across
// ranks. Meant for frozen weights (a base model under adapters): their values change by up to s_r / 2 per
// element, every step the same way.
class Int8RowwiseAllGather final : public AllGatherTransform {
 public:
  std::vector<TensorSpec> input_specs(c10::IntArrayRef padded_shard_sizes, c10::ScalarType shard_dtype) const override;
  std::vector<at::Tensor> pre_all_gather(const at::Tensor& padded_shard) const override;
  at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered, c10::ScalarType param_dtype) const override;
};

}  // namespace fsdp
