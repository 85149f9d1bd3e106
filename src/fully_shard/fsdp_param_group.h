#pragma once
// FSDPParamGroup: the parameters of one fully_shard call, communicated together (Python's
// _fsdp_param_group.py): one all-gather to unshard them, one reduce-scatter (plus one all-reduce across the
// replicate dim for HSDP) to reduce their gradients.

#include "fully_shard/fsdp_collectives.h"
#include "fully_shard/fsdp_param.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/process_group.h>

#include <memory>
#include <optional>
#include <string>
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
};

// A gradient reduction in flight: its result is applied to the sharded gradients on finish().
struct PendingReduce {
  Work reduce_scatter;
  at::Tensor input;   // kept alive until the collective completes
  at::Tensor output;  // reduce-scatter output [per_rank_numel]
  ReduceScatterLayout layout;
};

class FSDPParamGroup {
 public:
  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, MeshInfo mesh_info, FullyShardOptions options);

  const std::vector<FSDPParam*>& params() const { return param_ptrs_; }
  const MeshInfo& mesh_info() const { return mesh_info_; }
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  // --- unshard / reshard -------------------------------------------------------------------------------
  // Issues the all-gather (asynchronous); wait_for_unshard() completes it and shows the full parameters.
  void unshard();
  void wait_for_unshard();
  bool is_unsharded() const { return is_unsharded_; }
  // In flight = issued, not yet waited (a completed-at-once Work, e.g. on one rank, is not "valid").
  bool unshard_in_flight() const { return all_gather_output_.defined(); }
  // Frees the full parameters. With reshard_after_forward = N after forward, keeps an N-way sharded copy.
  void reshard(bool keep_post_forward_shard = false);

  // --- meta-device init ---------------------------------------------------------------------------------
  void materialize();         // real shard storage on the mesh's device for parameters created on meta
  void write_back_shards();   // unsharded (shown) parameters -> this rank's shards

  // --- forward / backward steps ------------------------------------------------------------------------
  void pre_forward();
  void post_forward(bool grad_enabled);
  void pre_backward();
  // Reduces gradients (or accumulates them when sync is off) and reshards. Idempotent per backward.
  void post_backward();
  void finish_pending_reduce();
  bool needs_post_backward() const { return needs_post_backward_; }
  void end_of_backward();  // final-callback cleanup

  // --- policy --------------------------------------------------------------------------------------------
  bool reshard_after_forward() const;          // frees (fully or to the post-forward shard) after forward
  void set_reshard_after_forward(ReshardAfterForward value);
  void set_default_reshard_after_forward(bool is_root);
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool reshard_after_backward = true;
  std::optional<double> gradient_divide_factor;

 private:
  void ensure_post_forward_group();
  ProcessGroupPtr unshard_group() const;  // the shard group, or the post-forward group when re-gathering from it

  std::vector<std::unique_ptr<FSDPParam>> params_;
  std::vector<FSDPParam*> param_ptrs_;
  MeshInfo mesh_info_;
  FullyShardOptions options_;
  std::string name_;
  AllGatherLayout layout_;

  std::optional<ReshardAfterForward> reshard_after_forward_;
  int64_t post_forward_size_ = 0;  // N of reshard_after_forward = N (0 = none)
  ProcessGroupPtr post_forward_group_;
  at::Tensor post_forward_shard_;  // [shard_size / N ranks, per_rank_bytes] uint8, when kept

  bool is_unsharded_ = false;
  Work all_gather_;
  at::Tensor all_gather_output_;
  bool needs_post_backward_ = false;
  bool ran_pre_backward_ = false;
  std::optional<PendingReduce> pending_reduce_;
};

}  // namespace fsdp::detail
