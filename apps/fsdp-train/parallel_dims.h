#pragma once
// The parallel dimensions of a job: the [parallelism] degrees and the batch sizes resolved against the world size
// (data_parallel_shard_degree -1 = the ranks left over, gradient accumulation from the batch sizes, pipeline
// microbatches), with an error naming the keys when they cannot fit. TorchTitan's ParallelDims; the mesh itself is
// built by the parallelize step (parallelize.h). No torch headers.

#include "config.h"

#include <cstdint>

namespace fsdp_train {

// Degrees resolved against the world size: shard -1 = leftover; gradient accumulation from the batch sizes.
struct ParallelDims {
  int64_t world_size = 1;
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t tp = 1;  // tensor-parallel degree (innermost mesh dim: ranks r*tp .. r*tp+tp-1 share a data shard)
  int64_t pp = 1;  // pipeline degree (outermost mesh dim: the pp ranks of a data-parallel rank read the same samples)
  int64_t pp_microbatches = 1;
  // expert-parallel degree, borrowed from dp_shard x cp x tp (TorchTitan): ranks r*ep .. r*ep+ep-1 of the
  // flattened dp_shard x cp x tp ranks split the experts; efsdp() = dp_shard x cp x tp / ep shard each expert
  // (FSDP). Every rank of those routes its own tokens (its cp chunks, its tp slice of them).
  int64_t ep = 1;
  int64_t efsdp() const { return dp_shard * cp * tp / ep; }
  // context-parallel degree (mesh dim between dp_shard and tp): the cp ranks of a data-parallel rank read the same
  // samples and each keeps its chunks of every sequence; FSDP shards over dp_shard x cp (TorchTitan's dp_shard_cp).
  int64_t cp = 1;
  int64_t dp_degree() const { return dp_replicate * dp_shard; }
  // The data-parallel rank of a world rank (mesh [pp, dp_replicate, dp_shard, cp, tp]).
  int64_t dp_rank_of(int64_t rank) const { return (rank % (dp_degree() * cp * tp)) / (cp * tp); }
  // The context-parallel rank of a world rank (its coordinate on the cp dim).
  int64_t cp_rank_of(int64_t rank) const { return (rank / tp) % cp; }
  // [fault_tolerance]: this job is replica group ft_replica of ft_groups; every global batch is split over all of
  // them (TorchTitan's ft get_dp_info): data-parallel rank d of group g reads as data rank g x dp_degree + d of
  // ft_groups x dp_degree.
  int64_t ft_groups = 1;
  int64_t ft_replica = 0;
  int64_t data_degree() const { return dp_degree() * ft_groups; }
  int64_t data_rank_of(int64_t rank) const { return ft_replica * dp_degree() + dp_rank_of(rank); }
  int64_t local_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t grad_accum_steps = 1;  // global / (local x dp x ft_groups)
};
// validate()s the config first (the divisions need positive degrees and batch sizes); a ConfigError names the keys
// and the world size when the degrees do not fit.
ParallelDims resolve_parallelism(const JobConfig& config, int64_t world_size);

}  // namespace fsdp_train
