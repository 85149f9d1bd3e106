#pragma once
// The state of one FSDP parameter group, and the only way to change it (Python's TrainingState plus the
// facts that _fsdp_param_group.py keeps in separate attributes: whether the parameters are unsharded, an
// all-gather is in flight, a reduction is in flight).
//
// A group's state has four parts:
//   phase   where the group is in the step: idle, forward, pre-backward, post-backward;
//   shard   what its parameters show: their shards, their shards with an N-way copy kept after forward for
//           backward (reshard_after_forward = N), or the full (unsharded) parameters;
//   gather  whether an all-gather (or the world-1 local unshard) was issued and not yet waited;
//   reduce  whether a gradient reduction was issued and not yet finished.
// Every change goes through StateMachine::apply(event), which looks the edge up in one table (next_state) and
// refuses an illegal one with an error naming the group, its state and the event. docs/fully_shard.md draws
// the same table; tests/fully_shard/state_machine_test.cpp walks every legal edge and tries every illegal one.

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::detail {

enum class Phase : uint8_t { Idle, Forward, PreBackward, PostBackward };
enum class ShardStatus : uint8_t { Sharded, ShardedPostForward, Unsharded };
enum class GatherStatus : uint8_t { None, InFlight };
enum class ReduceStatus : uint8_t { None, InFlight };

struct GroupState {
  Phase phase = Phase::Idle;
  ShardStatus shard = ShardStatus::Sharded;
  GatherStatus gather = GatherStatus::None;
  ReduceStatus reduce = ReduceStatus::None;
  bool operator==(const GroupState& o) const {
    return phase == o.phase && shard == o.shard && gather == o.gather && reduce == o.reduce;
  }
  bool operator!=(const GroupState& o) const { return !(*this == o); }
};

enum class Event : uint8_t {
  // Phase events (driven by the hooks in FSDPState).
  PreForward,    // the first member of the group enters forward
  PostForward,   // the group's forward finished (every member that runs returned), or a non-root call threw
  PreBackward,   // a gradient reached an output of one of the group's forward calls
  PostBackward,  // a forward call's inputs got their gradients: that use's backward is done
  EndBackward,   // the root's end-of-backward callback
  Reset,         // recovery after an exception, or FSDPModule::reset(): everything back to the start
  // Data events (driven by FSDPParamGroup).
  IssueGather,              // all-gather issued (or the world-1 local unshard)
  FinishGather,             // the all-gather waited and copied out: the parameters show full data
  DropGather,               // an all-gather nobody used was waited and dropped
  ShowUnshardedNoGather,    // full-sized parameters without data (set_unshard_in_backward(false))
  Reshard,                  // back to the shards (also: an N-way post-forward copy discarded)
  ReshardKeepPostForward,   // back to the shards, keeping an N-way copy for backward (reshard_after_forward = N)
  IssueReduce,              // reduce-scatter issued
  FinishReduce,             // reduction completed into the sharded gradients (or waited and dropped)
};
constexpr int kNumEvents = static_cast<int>(Event::FinishReduce) + 1;

const char* to_string(Phase phase);
const char* to_string(ShardStatus shard);
const char* to_string(Event event);
std::string to_string(const GroupState& state);

// The transition table: the state after `event`, or nullopt when the edge is illegal. Pure (no side effects).
std::optional<GroupState> next_state(const GroupState& state, Event event);

// True when a state found at the root's next forward (outside any backward pass), or at a backward's start,
// means an earlier forward or backward was abandoned by an exception: its hooks will never complete it.
// in_backward: a backward pass of the autograd engine is running on this thread.
bool is_abandoned(Phase phase, bool in_backward);

class StateMachine {
 public:
  explicit StateMachine(std::string owner = "") : owner_(std::move(owner)) {}
  void set_owner(std::string owner) { owner_ = std::move(owner); }
  const GroupState& state() const { return state_; }
  Phase phase() const { return state_.phase; }
  ShardStatus shard() const { return state_.shard; }
  bool unsharded() const { return state_.shard == ShardStatus::Unsharded; }
  bool gather_in_flight() const { return state_.gather == GatherStatus::InFlight; }
  bool reduce_in_flight() const { return state_.reduce == ReduceStatus::InFlight; }
  // Applies the edge or throws (c10::Error) naming the owner, the state and the event; the state is unchanged
  // then.
  void apply(Event event);
  // Count of edges applied (tests: the machine actually ran).
  int64_t transitions() const { return transitions_; }

 private:
  std::string owner_;
  GroupState state_;
  int64_t transitions_ = 0;
};

}  // namespace fsdp::detail
