#pragma once
// Buffer layouts and copies around FSDP's two collectives (Python's _fsdp_collectives.py).
//
// All-gather: one flat byte buffer per parameter group and rank, so a group with parameters of different
// dtypes still needs exactly one collective. Each parameter's padded shard occupies an aligned byte range
// of every rank's slot; the output is rank-major [world, per_rank_bytes].
// Reduce-scatter: one [world, per_rank_numel] buffer in the reduce dtype; rank r's slot holds, for every
// parameter, the gradient rows that rank r owns (zero padded), so the reduce-scatter leaves each rank with
// its own gradient shard.

#include "fully_shard/fsdp_param.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp::detail {

struct AllGatherLayout {
  std::vector<int64_t> byte_offsets;  // per parameter, within a rank's slot
  std::vector<int64_t> byte_sizes;    // padded shard bytes in the parameter's unsharded dtype
  int64_t per_rank_bytes = 0;
};
AllGatherLayout make_all_gather_layout(const std::vector<FSDPParam*>& params);

// Copies this rank's padded shards (cast to each parameter's param_dtype) into `slot` (per_rank_bytes uint8).
void pack_sharded(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, const at::Tensor& slot);
// Copies rows owned by ranks [first_rank, first_rank + dst.size(0)) of every unsharded parameter into `dst`
// ([n_ranks, per_rank_bytes] uint8): the kept copy of reshard_after_forward=N.
void pack_unsharded_rows(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                         int64_t first_rank, const at::Tensor& dst);
// Copies a full all-gather output ([world * per_rank_bytes] uint8) into every parameter's unsharded storage.
void unpack_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                       const at::Tensor& output);

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

}  // namespace fsdp::detail
