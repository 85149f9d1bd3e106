#pragma once
// FSDP's two collectives as functions (Python's _fsdp_collectives.py): foreach_all_gather owns the copy-in, the
// stream order and the all-gather and returns its result; foreach_all_gather_copy_out rebuilds the parameters
// from it; foreach_reduce_scatter packs, orders and issues the gradient reduce-scatter; finish_reduce completes
// it (HSDP all-reduce, hook, division, sharded gradients). The collective itself is pluggable (FSDPAllGather /
// FSDPReduceScatter, fully_shard_extensions.h); FSDPParamGroup only orchestrates when each runs.
//
// All-gather: one flat byte buffer per parameter group and rank, so a group with parameters of different
// dtypes still needs exactly one collective. Each parameter's padded shard occupies an aligned byte range
// of every rank's slot; the output is rank-major [world, per_rank_bytes].
// Reduce-scatter: one [world, per_rank_numel] buffer in the reduce dtype; rank r's slot holds, for every
// parameter, the gradient rows that rank r owns (zero padded), so the reduce-scatter leaves each rank with
// its own gradient shard.

#include "fully_shard/fsdp_param.h"
#include "fully_shard/fsdp_streams.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/fully_shard_extensions.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

namespace fsdp::detail {

// Which ranks a group communicates with (Python's FSDPMeshInfo / HSDPMeshInfo).
struct MeshInfo {
  DeviceMesh mesh;
  ProcessGroupPtr shard_group;
  ProcessGroupPtr replicate_group;  // null for 1-D meshes
  int64_t shard_rank = 0;
  int64_t shard_size = 1;
  int64_t replicate_size = 1;
  c10::Device device{c10::kCPU};
  bool hsdp() const { return replicate_group && replicate_size > 1; }
};

// How gradients are divided by the data-parallel size (Python's _get_gradient_divide_factors): inside the
// collectives (Avg, or a pre-multiplied sum), or as Sum with a division before (fp16: ~sqrt(N), against
// overflow) and after.
struct GradientDivision {
  std::optional<double> pre_divide;   // applied to the reduce-scatter input
  std::optional<double> post_divide;  // applied after the all-reduce hook
  ReduceOp reduce_scatter_op = ReduceOp::Sum;
  ReduceOp all_reduce_op = ReduceOp::Sum;
};
GradientDivision gradient_division(c10::ScalarType reduce_dtype, int64_t shard_size, int64_t replicate_size,
                                   std::optional<double> factor, bool force_sum);

// The built-in collectives: a plain buffer and the process group's own all-gather / reduce-scatter.
std::shared_ptr<FSDPAllGather> default_all_gather();
std::shared_ptr<FSDPReduceScatter> default_reduce_scatter();

struct AllGatherLayout {
  std::vector<int64_t> byte_offsets;  // per parameter, within a rank's slot
  std::vector<int64_t> byte_sizes;    // its bytes: the padded shard in param_dtype, or all its transform's inputs
  // Per parameter with an all-gather transform: each input's place inside the parameter's range (else empty).
  struct TransformInput {
    int64_t byte_offset = 0;  // within the rank's slot
    int64_t byte_size = 0;
    std::vector<int64_t> sizes;
    c10::ScalarType dtype = c10::kByte;
  };
  std::vector<std::vector<TransformInput>> transform_inputs;
  int64_t per_rank_bytes = 0;
};
AllGatherLayout make_all_gather_layout(const std::vector<FSDPParam*>& params);

// Copies this rank's padded shards (cast to each parameter's param_dtype) into `slot` (per_rank_bytes uint8).
void pack_sharded(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, const at::Tensor& slot);
// Copies rows owned by ranks [first_rank, first_rank + dst.size(0)) of every unsharded parameter into `dst`
// ([n_ranks, per_rank_bytes] uint8): the kept copy of reshard_after_forward=N.
void pack_unsharded_rows(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                         int64_t first_rank, const at::Tensor& dst);
// Copies a full all-gather output ([world * per_rank_bytes] uint8) into every parameter's unsharded storage
// (rebuilding transformed parameters through their transform).
void unpack_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                       const at::Tensor& output);

// An all-gather issued by foreach_all_gather.
struct AllGatherResult {
  Work work;
  at::Tensor output;                  // [world * per_rank_bytes] uint8, from the collective's allocate()
  std::optional<c10::Stream> stream;  // where the collective was issued (none: the current stream)
};
// Python's foreach_all_gather. With streams: the copy-in stream waits for the current stream (an optimizer step
// or state-dict load may just have written the shards), the output is allocated there and this rank's slot
// filled (shards cast to param_dtype, host-to-device when offloaded; transformed parameters through their
// transform) — or, with `post_forward_rows` (reshard_after_forward = N), that kept copy is the input; the
// all-gather stream waits for the copy-in and runs the collective on `group`. Without streams everything runs on
// the current stream.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                                   const at::Tensor& post_forward_rows, ProcessGroup& group, int64_t shard_world,
                                   int64_t shard_rank, c10::Device device, CommStreams* streams,
                                   FSDPAllGather& collective);
// Completes an all-gather: the collective waited on the stream it was issued on, the current stream ordered after
// it (on the event recorded there, not the whole stream: a later prefetch may already be queued on it).
void wait_all_gather(AllGatherResult& result, CommStreams* streams);
// Python's foreach_all_gather_copy_out: allocates every parameter's unsharded storage and unpacks the output
// into it, on the current stream. Returns the event after the copy-out (empty without streams).
StreamEvent foreach_all_gather_copy_out(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                                        const at::Tensor& output, CommStreams* streams);

struct ReduceScatterLayout {
  std::vector<int64_t> offsets;  // per parameter (elements within a rank's slot); -1 = not reduced
  int64_t per_rank_numel = 0;
  c10::ScalarType dtype = c10::kFloat;
};
// grads[i] is parameter i's unsharded gradient or undefined (skipped).
ReduceScatterLayout make_reduce_scatter_layout(const std::vector<FSDPParam*>& params,
                                               const std::vector<at::Tensor>& grads);
// [world * per_rank_numel] in layout.dtype, on `device` (the compute device: the collective's input never lands on
// the CPU because the first parameter happened to have no gradient).
at::Tensor pack_reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                                     const ReduceScatterLayout& layout, c10::Device device);
// Parameter i's reduced rows [rows_of(rank), ...] out of the reduce-scatter output [per_rank_numel].
at::Tensor reduced_local_grad(const FSDPParam& param, const ReduceScatterLayout& layout, size_t index,
                              const at::Tensor& output);

// A gradient reduction in flight: its result is applied to the sharded gradients by finish_reduce.
struct PendingReduce {
  Work reduce_scatter;
  at::Tensor input;   // kept alive until the collective completes
  at::Tensor output;  // reduce-scatter output [per_rank_numel]
  ReduceScatterLayout layout;
  GradientDivision division;
  std::optional<c10::Stream> stream;  // the reduce-scatter stream it was issued on (none: the current stream)
};
// Python's foreach_reduce, first half: the unsharded gradients (grads[i] of params[i], undefined = none) are
// packed on the current stream, where autograd produced them (so they can be freed at once); the reduce-scatter
// stream waits for that, pre-divides and issues the reduce-scatter over the shard group. `comm` (null without
// streams) releases the previous reduce-scatter's input first.
PendingReduce foreach_reduce_scatter(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> grads,
                                     const MeshInfo& mesh, std::optional<double> divide_factor, bool force_sum,
                                     CommContext* comm, FSDPReduceScatter& collective);
// The second half: waits for the reduce-scatter; for HSDP either keeps the result apart as a partial
// (requires_all_reduce = false: joins the next all-reduce) or adds earlier partials and all-reduces across
// replicas on the all-reduce stream; then the hook, the post-division, and each parameter's rows added into its
// sharded gradient. Returns the event after the last write (empty without streams) and whether non-blocking
// copies to pinned host gradients were started.
struct ReduceFinish {
  StreamEvent post_reduce;
  bool copying_to_host = false;
};
ReduceFinish finish_reduce(PendingReduce pending, const std::vector<FSDPParam*>& params, const MeshInfo& mesh,
                           bool requires_all_reduce, const FSDPModule::AllReduceHook& hook, CommContext* comm);

}  // namespace fsdp::detail
