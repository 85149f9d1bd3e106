#pragma once
// fsdp-train's side of replica-group fault tolerance ([fault_tolerance]; TorchTitan's components/ft with torchft):
// fsdp::ft::Manager (include/fsdp/fault_tolerance.h) plus what only the trainer knows — which gradients to
// average over the quorum, which state a healing group receives (the model's and the optimizer's shards, the step,
// the data position), and where the data of a step comes from. docs/reliability.md, "fsdp-train across replica
// groups", has the whole picture.
//
// Every step of a fault-tolerant run is one cycle:
//   begin_step   join the step's quorum; a group behind it (restarted, or resumed after a stop) receives the state
//                of a live group, shard index by shard index, and moves on to that group's step; a group at the
//                quorum's step sends its state to those behind
//   (training)   forward and backward as usual; each fully_shard module's reduced gradient is averaged over the
//                quorum's groups as FSDP produces it (FSDP's all-reduce hook), the loss likewise
//   commit       the vote: the optimizer steps only if every rank of every member voted ok in time; otherwise
//                every survivor drops the step and retries it with the next quorum (same batches)

#include "checkpoint_seam.h"
#include "config.h"

#include <fsdp/process_group.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace at {
class Tensor;
}
namespace fsdp {
class FSDPModule;
}

namespace fsdp_train {

// [fault_tolerance]: the coordinator's address is given (fault_tolerance.lighthouse, or the environment variable
// FSDP_LIGHTHOUSE); a ConfigError saying how otherwise. fsdp-train checks it before any process group.
void check_coordinator_given(const JobConfig& config);

class FaultTolerance {
 public:
  // `replica_group`: this job's world (one replica group); `say`: this rank prints the group's FT lines.
  FaultTolerance(const JobConfig& config, fsdp::ProcessGroupPtr replica_group, bool say);
  ~FaultTolerance();
  FaultTolerance(const FaultTolerance&) = delete;
  FaultTolerance& operator=(const FaultTolerance&) = delete;

  // Installs the average over the quorum as every module's all-reduce hook (FSDP's and HSDP's gradient path).
  void attach(std::vector<fsdp::FSDPModule>& modules);
  // Joins the quorum for the step after state.step; heals (state.step, the model, the optimizer and the loader
  // move to the sender's step) or serves peers. Returns false when a transfer failed (vote false on this step).
  bool begin_step(TrainState& state);
  // The parameters' gradients averaged over the quorum in one flat all-reduce: without fully_shard, and for the
  // modules whose gradients the all-reduce hook cannot take (several parameter groups, e.g. an MoE block under EP).
  void average_gradients(const std::vector<at::Tensor>& params);
  double average(double value);  // e.g. the step's loss, over the quorum's groups
  // Integer-valued counts (e.g. an MoE layer's tokens per expert) summed over the quorum's groups, in place: each
  // group then holds the counts of the whole quorum's batch. Before commit, like every quorum transfer.
  void sum_counts(at::Tensor& counts);
  bool commit(bool local_ok, int64_t step);  // the vote; prints why a step was discarded
  const std::vector<int>& members() const;  // the current quorum's replica ids
  // What this group loaded at start-up: the step of the checkpoint it read, or -1 for none. The healing line says it
  // (healing itself reads no checkpoint; a group that also loaded one at start-up must not be told it read none).
  void set_started_from(int64_t checkpoint_step);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_train
