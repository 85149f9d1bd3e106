#pragma once
// FSDPParamGroup: the parameters of one fully_shard call, communicated together (Python's
// _fsdp_param_group.py): one all-gather to unshard them, one reduce-scatter (plus one all-reduce across the
// replicate dim for HSDP) to reduce their gradients.
//
// The group's state — phase, shard status, gather and reduction in flight — is one StateMachine
// (state_machine.h): every change goes through its table, and docs/fully_shard.md draws it. The FSDPState of
// the module reads the phase from here instead of keeping a copy.

#include "fully_shard/fsdp_collectives.h"
#include "fully_shard/fsdp_param.h"
#include "fully_shard/fsdp_streams.h"
#include "fully_shard/state_machine.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/process_group.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace fsdp::detail {

// A mesh's identity, the same on every rank: its device type, the layout of its root mesh (shape, dim names,
// row-major ranks) and the dims it keeps. Sub-meshes with equal identities hold the same process groups (or,
// from two identically built roots, groups over the same ranks): fully_shard puts the parameters placed on
// them in one group, and clip_grad_norm_ keys its reductions by it (dim names alone are not enough: an expert
// mesh and the dense mesh may both call their shard dim "shard").
std::string mesh_identity(const DeviceMesh& mesh);

class FSDPParamGroup {
 public:
  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, MeshInfo mesh_info, FullyShardOptions options);

  const std::vector<FSDPParam*>& params() const { return param_ptrs_; }
  const MeshInfo& mesh_info() const { return mesh_info_; }
  const std::string& name() const { return name_; }
  void set_name(std::string name) {
    name_ = std::move(name);
    machine_.set_owner(name_);
  }
  const StateMachine& state_machine() const { return machine_; }
  Phase phase() const { return machine_.phase(); }

  // --- streams -----------------------------------------------------------------------------------------
  // The root's streams and held buffers (set at the root's lazy init; before that everything runs on the
  // current stream, as on a device without streams).
  void set_comm_context(std::shared_ptr<CommContext> comm) { comm_ = std::move(comm); }

  // --- unshard / reshard -------------------------------------------------------------------------------
  // Issues the all-gather (asynchronous); wait_for_unshard() completes it and shows the full parameters.
  // on_comm_streams: copy-in and all-gather on the all-gather streams (FSDP's own unshards and prefetches);
  // false for an explicit FSDPModule::unshard, which runs on the current stream (as Python's does).
  void unshard(bool on_comm_streams = true);
  void wait_for_unshard();
  bool is_unsharded() const { return machine_.unsharded(); }
  // In flight = issued, not yet waited.
  bool unshard_in_flight() const { return machine_.gather_in_flight(); }
  // World-size-1 fast path (FSDPParam::aliases_shard for every parameter): unshard shows the shards
  // themselves, no buffer, copy or collective.
  bool unshards_locally() const;
  // ... and gradients are handed to the sharded .grad as autograd produced them (no reduce-scatter, no
  // copy): no replicas to all-reduce with, no division, no hook that expects a reduced buffer.
  bool hands_over_gradients() const;
  // Frees the full parameters (waiting for and dropping an unused in-flight all-gather first). With
  // keep_post_forward_shard and reshard_after_forward = N, keeps an N-way sharded copy for backward.
  void reshard(bool keep_post_forward_shard = false);
  // Waits for an all-gather nobody consumed and drops it (ranks stay matched: every rank issued it).
  void drop_unused_unshard();

  // --- meta-device init ---------------------------------------------------------------------------------
  void materialize();  // real shard storage on the mesh's device for parameters created on meta
  // Shows full parameters in their original dtype for an initializer, without a round trip through
  // param_dtype; parameters freshly materialized need no communication at all (their shards are known
  // zeros). `only`: the parameters to show (those of the part being initialized); null = all.
  void begin_full_init(const std::unordered_set<const c10::TensorImpl*>* only = nullptr);
  void end_full_init();  // keeps this rank's rows, shows the shards again

  // --- forward / backward steps ------------------------------------------------------------------------
  void pre_forward();
  // One forward call with gradients enabled ("a use"); registered_node: its inputs got a post-backward node.
  void record_use(bool registered_node);
  void forget_use(bool registered_node);  // a call that threw: its backward will never run
  void post_forward(bool grad_enabled);
  void pre_backward();
  // From a post-backward node: this use's gradients are complete. Reduces now when no other use of the group
  // can still add gradients in this backward, otherwise defers to finish_backward.
  void post_backward_from_node();
  // End of a backward pass (the root's final callback): reduces what was deferred or never reached,
  // drops unused prefetches, reshards. keep_graph: the graph may be run again. finalize: also complete the
  // reductions before the optimizer reads the gradients (false for a backward that set_is_last_backward(false)
  // marked as not the last: its reductions may stay in flight). force_sync: reduce even with gradient sync off
  // (FSDPModule::post_backward, a schedule's explicit reduction).
  void finish_backward(bool keep_graph, bool finalize = true, bool force_sync = false);
  void finish_pending_reduce();
  bool has_pending_reduce() const { return machine_.reduce_in_flight(); }
  // After an exception anywhere in forward or backward: waits for in-flight collectives, drops unsharded
  // parameters and every gradient FSDP holds internally, returns to Idle. Sharded .grad keep what was
  // reduced before the failure.
  void reset();

  // The first parameter autograd used while it showed its shard after this group's forward, or null.
  const FSDPParam* used_outside_forward() const;

  // --- caches that must never outlive a change of the shards -----------------------------------------------
  // Drops the hpZ copy kept after forward (and re-checks in-flight gathers) when the shards changed.
  void invalidate_caches();

  // --- policy --------------------------------------------------------------------------------------------
  bool reshard_after_forward() const;  // frees (fully or to the post-forward shard) after forward
  void set_reshard_after_forward(ReshardAfterForward value);
  void set_default_reshard_after_forward(bool is_root);
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool reshard_after_backward = true;
  bool unshard_in_backward = true;  // false: pre-backward shows full-sized parameters without gathering data
  bool force_sum_reduction_for_comms = false;
  std::optional<double> gradient_divide_factor;
  FSDPModule::AllReduceHook all_reduce_hook;
  // FSDPModule::set_custom_all_gather / set_custom_reduce_scatter (null = the built-in collective). Between
  // steps only: an all-gather in flight keeps the object it was issued with.
  void set_custom_all_gather(std::shared_ptr<FSDPAllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<FSDPReduceScatter> comm);
  // Backward prefetch of this group (no-op when unshard_in_backward is off).
  void unshard_for_backward();

  // --- conversion (module->to(dtype) after fully_shard) ----------------------------------------------------
  void convert_dtype(c10::ScalarType dtype, const MixedPrecisionPolicy& mp);

 private:
  void ensure_post_forward_group();
  // Drops the N-way copy kept after forward (stale, or no longer wanted): the group shows its plain shards.
  void discard_post_forward_shard();
  // Forgets what was cached from the current shards (the hpZ copy's tensor and version, each parameter's
  // "gradient known zero"), without a state change: shared by invalidate_caches() and reset().
  void forget_cached_shard_copies();
  CommStreams* streams() const { return comm_ && comm_->streams.separate() ? &comm_->streams : nullptr; }
  // The current stream waits for this group's last reduction (and the host for offloaded gradients' copies).
  void wait_for_post_reduce();
  // Reduces (or, without gradient sync and unless forced, accumulates) the gradients on the unsharded
  // parameters, reshards.
  void reduce_gradients(bool force_sync = false);
  int64_t shards_version() const;

  std::vector<std::unique_ptr<FSDPParam>> params_;
  std::vector<FSDPParam*> param_ptrs_;
  MeshInfo mesh_info_;
  FullyShardOptions options_;
  std::string name_;
  AllGatherLayout layout_;
  StateMachine machine_;

  std::optional<ReshardAfterForward> reshard_after_forward_;
  int64_t post_forward_size_ = 0;  // N of reshard_after_forward = N (0 = none)
  ProcessGroupPtr post_forward_group_;
  at::Tensor post_forward_shard_;  // [shard_size / N ranks, per_rank_bytes] uint8: defined iff ShardedPostForward
  int64_t post_forward_shard_version_ = -1;

  AllGatherResult all_gather_;  // while a gather is in flight (empty on the world-1 local path)
  std::shared_ptr<FSDPAllGather> all_gather_comm_ = default_all_gather();
  std::shared_ptr<FSDPReduceScatter> reduce_scatter_comm_ = default_reduce_scatter();
  int64_t all_gather_version_ = -1;  // shards_version() when the in-flight gather packed them
  std::shared_ptr<CommContext> comm_;
  // Marks the end of the last reduction's work on the reduce-scatter / all-reduce stream (the sharded
  // gradients are written there); the current stream waits on it at the end of backward.
  StreamEvent post_reduce_event_;
  // After non-blocking device-to-host copies of offloaded gradients: the host waits on it before the
  // optimizer can read them (end of backward).
  StreamEvent grad_offload_event_;

  // Backward accounting for repeated use. A forward call with gradients enabled is one "use"; a use whose
  // inputs required gradients got a post-backward node that tells when its gradients are complete; a use
  // without one is only known complete at the end of backward.
  int64_t uses_ = 0;
  int64_t uses_with_node_ = 0;
  int64_t nodes_fired_ = 0;  // in the current backward pass

  std::optional<PendingReduce> pending_reduce_;  // engaged iff the machine's reduction is in flight
};

}  // namespace fsdp::detail
