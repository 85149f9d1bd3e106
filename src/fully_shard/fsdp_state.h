#pragma once
// FSDPState: what fully_shard attaches to a module (Python's FSDPState): the forward hooks that unshard and
// reshard its parameter groups, the autograd hooks that run pre-/post-backward, and — for the root, the
// first state to run forward — the context shared by every state under it (forward order for prefetching,
// the end-of-backward callback, recovery after exceptions).
//
// A state has one parameter group per mesh its parameters are sharded over (usually one; shard_placement_fn
// may put some parameters on another mesh, e.g. MoE experts). Its groups move through the phases together:
// every hook applies the same event to each of them, in group order. A state's phase is its groups' (read
// from the first group's StateMachine, state_machine.h); a state without parameters keeps a machine of its
// own. docs/fully_shard.md draws the transitions.

#include "fully_shard/fsdp_param_group.h"
#include "fully_shard/state_holder.h"

#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>

#include <c10/core/Event.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {

// Shared by the root and every state below it; created at the root's lazy init.
struct RootContext {
  std::vector<std::weak_ptr<FSDPState>> states;  // every state in the root's tree, root first (module order)
  // Post-forward order of the current root forward (every call, with or without gradients), and of the
  // previous one: implicit forward prefetch issues the state that followed last time.
  std::vector<FSDPState*> forward_order;
  std::vector<FSDPState*> last_forward_order;
  // The state whose call opened the forward now running (null between forwards): the root's, or a submodule's
  // run on its own outside the root's forward (a chunked loss calling the output head per chunk). When that
  // call returns, every group whose forward ran only partly (some members of fully_shard({a, b}) skipped) is
  // finished — PyTorch's iter_forward_root and _force_complete_incomplete_states.
  FSDPState* forward_root = nullptr;
  // Post-forward order of the calls with gradients since the last backward finished: backward runs in
  // reverse, so the call before a state's own is the next to need its parameters (implicit backward prefetch).
  std::vector<FSDPState*> backward_order;
  // The backward pass whose end-of-backward callback is queued (-1: none). A callback queued for a pass that
  // is no longer running never ran: that backward failed.
  int backward_graph_task = -1;
  // The groups whose gradient reductions are in flight, all of one state: at most one state's across the tree
  // bounds gradient memory (a state with groups on two meshes reduces both at once, on different communicators).
  std::vector<FSDPParamGroup*> groups_with_pending_reduce;
  // The communication streams and the buffers held across them (fsdp_streams.h), shared by every group.
  std::shared_ptr<CommContext> comm;
  // FSDPModule::set_post_optim_event: waited on (once) by the next root forward's all-gathers.
  std::optional<c10::Event> post_optim_event;
  int64_t post_optim_events_waited = 0;  // for tests
  // Set when recovery found the ranks out of step (FSDPState::check_ranks_in_step): every later use of the
  // tree repeats this error instead of issuing collectives that would pair with the wrong ones.
  std::optional<std::string> unusable;
  // FSDPModule::set_is_last_backward: false = the end of the next backward leaves reductions in flight and
  // keeps the backward order (more micro-batches follow); true (default) = it completes everything.
  bool is_last_backward = true;
};

// Internal access to an FSDPModule's state (the public header exposes no internals).
struct FSDPModuleAccess {
  static FSDPState& state(const FSDPModule& module);
  static std::shared_ptr<FSDPState> shared_state(const FSDPModule& module) { return module.state_; }
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // groups: one per mesh, the call's mesh first (none for a module without parameters to manage).
  FSDPState(std::vector<std::weak_ptr<torch::nn::Module>> modules,
            std::vector<std::unique_ptr<detail::FSDPParamGroup>> groups, FullyShardOptions options);

  // Installs the forward hooks and the gradient guards; called once by fully_shard.
  void attach();

  torch::nn::Module& module() const;  // the first module
  // Every parameter group of this state, one per mesh (empty without parameters).
  const std::vector<detail::FSDPParamGroup*>& param_groups() const { return group_ptrs_; }
  // The first group (on the call's mesh, unless none of the parameters is), or null. For single-mesh states;
  // code that walks a state's parameters uses param_groups().
  detail::FSDPParamGroup* param_group() const { return group_ptrs_.empty() ? nullptr : group_ptrs_.front(); }
  bool is_root() const { return is_root_.value_or(false); }
  const std::string& name() const { return name_; }
  const FullyShardOptions& options() const { return options_; }
  detail::Phase training_state() const;
  // fully_shard of an ancestor: this state must not become a root by running forward first.
  void set_has_fsdp_ancestor(std::string ancestor) { fsdp_ancestor_ = std::move(ancestor); }

  // Hooks (public for the autograd nodes and the final callback).
  void pre_forward(torch::nn::Module& module, nn::TensorList& inputs);
  void post_forward(torch::nn::Module& module, const nn::TensorList& inputs, nn::TensorList& outputs);
  void pre_backward();
  void post_backward();
  // A member's forward (or a hook after it) threw: undo this call (fsdp::nn::call's exception hook).
  void on_forward_exception(torch::nn::Module& module);

  // FSDPModule API.
  void unshard(bool async_op);
  void wait_for_unshard();
  void reshard();
  void reset();  // this state's tree back to idle after an exception (see FSDPModule::reset)
  void set_is_last_backward(bool is_last_backward);
  void explicit_post_backward();  // FSDPModule::post_backward
  void convert_dtype(c10::ScalarType dtype);  // module->to(dtype) after fully_shard
  std::vector<std::shared_ptr<FSDPState>> subtree_states();  // this state and every state below it
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;   // explicit; empty = implicit
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch;
  void set_post_optim_event(c10::Event event);
  const std::shared_ptr<detail::RootContext>& root_context() const { return ctx_; }
  // Buffers that MixedPrecisionPolicy::buffer_dtype cast at fully_shard, with their original dtypes (state
  // dicts report those).
  std::vector<std::pair<at::Tensor, c10::ScalarType>> cast_buffers;

 private:
  // Throws "process group unusable" unless every rank abandoned the step after the same collectives.
  void check_ranks_in_step(const std::vector<std::shared_ptr<FSDPState>>& states);
  void check_group_in_step(ProcessGroup& group);
  void lazy_init();
  void root_pre_forward();
  void root_post_forward();
  void root_final_callback();
  // The call that opened the forward returned: finishes the forward of every other state of the tree still in
  // forward with none of its members running (a group of modules of which only some ran).
  void finish_open_forwards();
  void wait_for_post_optim_event();
  // Releases the buffers kept across streams (fsdp_streams.h's HeldBuffer) once their streams waited.
  void release_held_buffers();
  void queue_final_callback();
  // True when the previous forward or backward of this root's tree was abandoned by an exception.
  bool needs_recovery() const;
  void prefetch_for_forward();
  void prefetch_for_backward();
  bool register_post_backward(nn::TensorList& inputs);
  void register_pre_backward(nn::TensorList& outputs);
  void cast_tensors(nn::TensorList& tensors, c10::ScalarType dtype) const;
  enum class CallRecord { NoUse, Use, UseWithNode };
  // A member's call leaves its forward (returned or threw): its record, or nullopt if pre_forward skipped it.
  std::optional<CallRecord> end_call(torch::nn::Module& module);
  // Completes the forward of the group (all members that ran have returned).
  void finish_forward();
  std::vector<std::shared_ptr<FSDPState>> context_states() const;
  // The machine that holds this state's phase: its first group's, or its own when it has no parameters.
  const detail::StateMachine& machine() const {
    return group_ptrs_.empty() ? own_machine_ : group_ptrs_.front()->state_machine();
  }
  // A phase event for a state without parameters (with groups, the groups' step methods apply it).
  void apply_without_group(detail::Event event) {
    if (group_ptrs_.empty()) own_machine_.apply(event);
  }
  // Names the groups after the state: the state's name, plus the mesh when there are several.
  void name_groups();
  // Issues every group's all-gather before any is waited: groups on different meshes use different
  // communicators, so their gathers overlap.
  void issue_gathers(bool for_backward);

  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  std::vector<std::unique_ptr<detail::FSDPParamGroup>> param_groups_;
  std::vector<detail::FSDPParamGroup*> group_ptrs_;  // param_groups_, as the accessor hands them out
  FullyShardOptions options_;
  std::string name_;
  std::optional<bool> is_root_;
  std::optional<std::string> fsdp_ancestor_;
  std::shared_ptr<detail::RootContext> ctx_;
  detail::StateMachine own_machine_;  // used only when there is no parameter group

  // Forward bookkeeping of the current call group: which members are inside their forward (a member may
  // be re-entered) or ran this round, and grad mode at the first pre-forward.
  std::map<const torch::nn::Module*, int> members_running_;
  std::set<const torch::nn::Module*> members_ran_;
  // One entry per call inside its forward (innermost last): whether it counted as a use for backward.
  std::vector<CallRecord> calls_;
  bool forward_grad_enabled_ = false;
  int forward_calls_this_root_forward_ = 0;  // for implicit forward prefetch with repeated use
  std::vector<size_t> backward_order_indices_;  // this state's positions in ctx_->backward_order
  std::optional<c10::Event> pending_post_optim_event_;  // set before the root's lazy init
  bool is_last_backward_before_init_ = true;            // likewise for set_is_last_backward
};

}  // namespace detail

// Internal code of the library names it without the namespace (the public headers do not: FSDPState is no
// public name).
using detail::FSDPState;

}  // namespace fsdp
