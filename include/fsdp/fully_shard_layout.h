#pragma once
// What fully_shard made of a module, read back without communication: per parameter group (one per mesh), the
// mesh and its shard / replicate degrees, and per parameter what the group all-gathers (this rank's tensor- or
// expert-parallel piece, the "unsharded" shape), the dim it shards, the padded rows every rank stores and the
// bytes it takes in each rank's all-gather slot. Works on parameters still on `meta` (a model built on meta and
// sharded under a fsdp::FakeWorld): fsdp-plan reads the trainer's real layout this way (docs/planner.md).

#include <fsdp/fully_shard.h>
#include <fsdp/sharded_tensor.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct ShardedParamLayout {
  std::string fqn;                       // within the module given to fully_shard
  std::vector<int64_t> unsharded_sizes;  // what the all-gather rebuilds (this rank's TP / EP piece)
  int64_t shard_dim = 0;
  int64_t padded_shard_numel = 0;        // ceil(rows / shard ranks) x row elements: every rank's storage
  int64_t local_numel = 0;               // this rank's rows, without padding (0 on a rank past the end)
  c10::ScalarType param_dtype = c10::kFloat;   // of the unsharded parameter (mixed precision's param_dtype)
  c10::ScalarType reduce_dtype = c10::kFloat;
  int64_t all_gather_bytes = 0;          // its part of a rank's all-gather slot, aligned as the group packs it
  // Under tensor parallelism: the global tensor over the [fsdp dims..., tp] mesh (else nullopt).
  std::optional<std::vector<int64_t>> global_sizes;
  std::optional<Placements> global_placements;
};

struct ParamGroupLayout {
  DeviceMesh mesh;               // 1-D (shard) or 2-D (replicate, shard)
  int64_t shard_size = 1, replicate_size = 1;
  int64_t all_gather_bytes = 0;  // one rank's slot: the sum of its parameters' all_gather_bytes
  std::vector<ShardedParamLayout> params;
};

// The parameter groups of `module`'s fully_shard (or replicate) call, the call's mesh first.
std::vector<ParamGroupLayout> param_group_layouts(const FSDPModule& module);

}  // namespace fsdp
