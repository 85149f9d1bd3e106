// See parallel_dims.h.
#include "parallel_dims.h"

#include <filesystem>
#include <string>

namespace fsdp_train {
namespace {

void check(bool ok, const std::string& msg) {
  if (!ok) throw ConfigError("config error: " + msg);
}

}  // namespace

ParallelDims resolve_parallelism(const JobConfig& c, int64_t world_size) {
  validate(c);  // the divisions below need positive degrees and batch sizes (found by fuzzing)
  check(world_size >= 1, "world size must be >= 1, got " + std::to_string(world_size));
  ParallelDims d;
  d.world_size = world_size;
  d.dp_replicate = c.parallelism.data_parallel_replicate_degree;
  d.tp = c.parallelism.tensor_parallel_degree;
  d.pp = c.parallelism.pipeline_parallel_degree;
  d.cp = c.parallelism.context_parallel_degree;
  check(world_size % d.pp == 0, "parallelism.pipeline_parallel_degree (" + std::to_string(d.pp) +
                                    ") must divide the world size (" + std::to_string(world_size) + ")");
  check((world_size / d.pp) % d.tp == 0, "parallelism.tensor_parallel_degree (" + std::to_string(d.tp) +
                                             ") must divide the world size" +
                                             (d.pp > 1 ? " / pipeline_parallel_degree (" : " (") +
                                             std::to_string(world_size / d.pp) + ")");
  check((world_size / d.pp / d.tp) % d.cp == 0,
        "parallelism.context_parallel_degree (" + std::to_string(d.cp) + ") must divide the world size" +
            (d.pp > 1 || d.tp > 1 ? " / (pipeline_parallel_degree x tensor_parallel_degree) (" : " (") +
            std::to_string(world_size / d.pp / d.tp) + ")");
  world_size /= d.tp * d.pp * d.cp;  // the data-parallel ranks
  const std::string W = std::to_string(world_size) +
                        (d.tp > 1 || d.pp > 1 || d.cp > 1
                             ? " = world / (pipeline_parallel_degree x context_parallel_degree x tensor_parallel_degree)"
                             : ""),
                    R = std::to_string(d.dp_replicate);
  if (c.parallelism.data_parallel_shard_degree == -1) {
    check(world_size % d.dp_replicate == 0, "parallelism.data_parallel_replicate_degree (" + R +
                                                ") must divide the world size (" + W + ") when data_parallel_shard_degree = -1");
    d.dp_shard = world_size / d.dp_replicate;
  } else {
    d.dp_shard = c.parallelism.data_parallel_shard_degree;
    int64_t product = 0;
    const bool overflow = __builtin_mul_overflow(d.dp_replicate, d.dp_shard, &product);
    check(!overflow && product == world_size,
          "parallelism.data_parallel_replicate_degree (" + R + ") x parallelism.data_parallel_shard_degree (" +
              std::to_string(d.dp_shard) + ") = " + (overflow ? "overflow" : std::to_string(product)) +
              ", expected the world size " + W);
  }
  if (c.fault_tolerance.enable) {
    d.ft_groups = c.fault_tolerance.group_size;
    d.ft_replica = c.fault_tolerance.replica_id;
  }
  d.local_batch_size = c.training.local_batch_size;
  int64_t per_micro = 0;
  const bool micro_overflow = __builtin_mul_overflow(d.local_batch_size, d.data_degree(), &per_micro);
  check(!micro_overflow,
        "training.local_batch_size (" + std::to_string(d.local_batch_size) + ") x data-parallel degree overflows");
  d.global_batch_size = c.training.global_batch_size == -1 ? per_micro : c.training.global_batch_size;
  check(d.global_batch_size % per_micro == 0,
        "training.global_batch_size (" + std::to_string(d.global_batch_size) +
            ") must be a multiple of training.local_batch_size (" + std::to_string(d.local_batch_size) +
            ") x data-parallel degree (" + std::to_string(d.dp_degree()) +
            (d.ft_groups > 1 ? " x fault_tolerance.group_size " + std::to_string(d.ft_groups) : std::string()) +
            ") = " + std::to_string(per_micro));
  d.grad_accum_steps = d.global_batch_size / per_micro;
  {
    // The data stream addresses token (step x global_batch_size + sample) x (seq_len + 1) of every step the run
    // may reach: that must fit int64, or the position arithmetic would overflow mid-run.
    int64_t per_step = 0, total = 0;
    const bool overflow = __builtin_mul_overflow(d.global_batch_size, c.training.seq_len + 1, &per_step) ||
                          __builtin_mul_overflow(per_step, c.training.steps, &total);
    check(!overflow, "training.global_batch_size (" + std::to_string(d.global_batch_size) + ") x (training.seq_len + 1 = " +
                         std::to_string(c.training.seq_len + 1) + ") x training.steps (" +
                         std::to_string(c.training.steps) + ") tokens overflow the data stream's 64-bit position");
  }
  d.ep = c.parallelism.expert_parallel_degree;
  if (d.ep > 1) {
    // TorchTitan's ParallelDims: ep | dp_shard x cp x tp, the experts' FSDP mesh (efsdp) is what is left.
    const int64_t borrowable = d.dp_shard * d.cp * d.tp;
    std::string factors = std::to_string(d.dp_shard), keys;
    if (d.cp > 1) factors += " x " + std::to_string(d.cp), keys += " x context_parallel_degree";
    if (d.tp > 1) factors += " x " + std::to_string(d.tp), keys += " x tensor_parallel_degree";
    check(borrowable % d.ep == 0,
          "parallelism.expert_parallel_degree (" + std::to_string(d.ep) + ") must divide the data-parallel shard degree" +
              (keys.empty() ? " (" + factors + "): expert parallelism borrows its ranks from FSDP's shard dim"
                            : keys + " (" + factors + " = " + std::to_string(borrowable) +
                                  "): expert parallelism borrows its ranks from FSDP's shard dim" +
                                  (d.cp > 1 ? ", the CP ranks" : "") + (d.tp > 1 ? " and the TP ranks" : "")));
  }
  if (d.pp > 1) {
    const int64_t n = c.parallelism.num_pp_microbatches;
    const int64_t size = c.parallelism.pipeline_parallel_microbatch_size;
    if (n > 0) {
      check(d.local_batch_size % n == 0, "parallelism.num_pp_microbatches (" + std::to_string(n) +
                                             ") must divide training.local_batch_size (" +
                                             std::to_string(d.local_batch_size) + ")");
      d.pp_microbatches = n;
    } else {
      check(d.local_batch_size % size == 0, "parallelism.pipeline_parallel_microbatch_size (" + std::to_string(size) +
                                                ") must divide training.local_batch_size (" +
                                                std::to_string(d.local_batch_size) + ")");
      d.pp_microbatches = d.local_batch_size / size;
    }
    // A schedule file is read when the stages are cut (its rows and cells are checked there, against the stage
    // count); here, before any process group, only that it is there (TorchTitan's check).
    const std::string& csv = c.parallelism.pipeline_parallel_schedule_csv;
    check(csv.empty() || std::filesystem::is_regular_file(csv),
          "parallelism.pipeline_parallel_schedule_csv: '" + csv + "' does not exist or is not a file");
    // Validation runs the same schedule forward-only: its batch splits into the same number of microbatches.
    check(!c.validation.enable || c.validation.local_batch_size % d.pp_microbatches == 0,
          "validation.local_batch_size (" + std::to_string(c.validation.local_batch_size) +
              ") must be a multiple of the pipeline's microbatches per step (" + std::to_string(d.pp_microbatches) +
              ") under parallelism.pipeline_parallel_degree > 1");
  }
  return d;
}

}  // namespace fsdp_train
