#include "fully_shard/state_machine.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::Idle: return "idle";
    case Phase::Forward: return "forward";
    case Phase::PreBackward: return "pre-backward";
    case Phase::PostBackward: return "post-backward";
  }
  return "?";
}

const char* to_string(ShardStatus shard) {
  switch (shard) {
    case ShardStatus::Sharded: return "sharded";
    case ShardStatus::ShardedPostForward: return "sharded with a post-forward copy";
    case ShardStatus::Unsharded: return "unsharded";
  }
  return "?";
}

const char* to_string(Event event) {
  switch (event) {
    case Event::PreForward: return "pre-forward";
    case Event::PostForward: return "post-forward";
    case Event::PreBackward: return "pre-backward";
    case Event::PostBackward: return "post-backward";
    case Event::EndBackward: return "end of backward";
    case Event::Reset: return "reset";
    case Event::IssueGather: return "issue all-gather";
    case Event::FinishGather: return "finish all-gather";
    case Event::DropGather: return "drop unused all-gather";
    case Event::ShowUnshardedNoGather: return "show unsharded without gathering";
    case Event::Reshard: return "reshard";
    case Event::ReshardKeepPostForward: return "reshard keeping the post-forward copy";
    case Event::IssueReduce: return "issue gradient reduction";
    case Event::FinishReduce: return "finish gradient reduction";
  }
  return "?";
}

std::string to_string(const GroupState& s) {
  std::string out = std::string(to_string(s.phase)) + ", " + to_string(s.shard);
  if (s.gather == GatherStatus::InFlight) out += ", all-gather in flight";
  if (s.reduce == ReduceStatus::InFlight) out += ", reduction in flight";
  return out;
}

std::optional<GroupState> next_state(const GroupState& s, Event event) {
  GroupState n = s;
  const bool sharded = s.shard != ShardStatus::Unsharded;
  const bool gathering = s.gather == GatherStatus::InFlight;
  switch (event) {
    // ---- phase ----------------------------------------------------------------------------------------
    case Event::PreForward:
      // From post-backward: activation-checkpoint recomputation of an earlier use of a group whose later use
      // already finished its backward (pre-backward itself skips the forward hooks: the group is gathered).
      if (s.phase != Phase::Idle && s.phase != Phase::PostBackward) return std::nullopt;
      n.phase = Phase::Forward;
      return n;
    case Event::PostForward:
      if (s.phase != Phase::Forward) return std::nullopt;
      n.phase = Phase::Idle;
      return n;
    case Event::PreBackward:
      // From post-backward: re-armed by an earlier use of the same group.
      if (s.phase != Phase::Idle && s.phase != Phase::PostBackward) return std::nullopt;
      n.phase = Phase::PreBackward;
      return n;
    case Event::PostBackward:
      // From post-backward: two uses whose pre-backward hooks both fired before either's post-backward.
      if (s.phase != Phase::PreBackward && s.phase != Phase::PostBackward) return std::nullopt;
      n.phase = Phase::PostBackward;
      return n;
    case Event::EndBackward:
      // Idle: the group took no part in this backward. Forward: a forward that never finished — a bug.
      if (s.phase == Phase::Forward) return std::nullopt;
      n.phase = Phase::Idle;
      return n;
    case Event::Reset:
      return GroupState{};
    // ---- data ---------------------------------------------------------------------------------------------
    case Event::IssueGather:
      if (gathering || !sharded) return std::nullopt;
      n.gather = GatherStatus::InFlight;
      return n;
    case Event::FinishGather:
      if (!gathering) return std::nullopt;
      n.gather = GatherStatus::None;
      n.shard = ShardStatus::Unsharded;
      return n;
    case Event::DropGather:
      if (!gathering) return std::nullopt;
      n.gather = GatherStatus::None;
      return n;
    case Event::ShowUnshardedNoGather:
      if (s.phase != Phase::PreBackward || gathering || !sharded) return std::nullopt;
      n.shard = ShardStatus::Unsharded;
      return n;
    case Event::Reshard:
      if (gathering || s.shard == ShardStatus::Sharded) return std::nullopt;
      n.shard = ShardStatus::Sharded;
      return n;
    case Event::ReshardKeepPostForward:
      if (gathering || s.shard != ShardStatus::Unsharded) return std::nullopt;
      n.shard = ShardStatus::ShardedPostForward;
      return n;
    case Event::IssueReduce:
      if (s.phase == Phase::Forward || s.reduce == ReduceStatus::InFlight) return std::nullopt;
      n.reduce = ReduceStatus::InFlight;
      return n;
    case Event::FinishReduce:
      if (s.reduce != ReduceStatus::InFlight) return std::nullopt;
      n.reduce = ReduceStatus::None;
      return n;
  }
  return std::nullopt;
}

bool is_abandoned(Phase phase, bool in_backward) {
  switch (phase) {
    case Phase::Idle: return false;
    case Phase::Forward: return true;  // only asked where no forward of the tree can legitimately be running
    case Phase::PreBackward:
    case Phase::PostBackward: return !in_backward;
  }
  return true;
}

void StateMachine::apply(Event event) {
  const std::optional<GroupState> next = next_state(state_, event);
  TORCH_CHECK(next.has_value(), "fsdp: illegal state transition of FSDP group ",
              owner_.empty() ? std::string("(unnamed)") : owner_, ": event '", to_string(event),
              "' in state (", to_string(state_), "). This is a bug in libfsdp or a use of FSDPModule that FSDP does not "
              "support at this point of the step; docs/fully_shard.md lists the legal transitions");
  state_ = *next;
  ++transitions_;
}

}  // namespace fsdp::detail
