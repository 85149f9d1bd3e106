// The parameter group's state machine (src/fully_shard/state_machine.h).
//
// 1. The table: every state reachable from the start, under every event, against the tables of
//    docs/fully_shard.md written out here independently (phase x event, data x event). Every legal edge is
//    walked; every illegal one must be refused with an error naming the group, the state and the event, and
//    leave the state unchanged.
// 2. The runtime: a real sharded model on 2 and 4 ranks shows the states the docs promise at each point of a
//    step (read from the group's machine inside forward, in backward hooks and between steps), and the
//    machine actually ran (its transition count moved).
#include "fully_shard/fsdp_state.h"
#include "fully_shard/fsdp_test_util.h"
#include "fully_shard/state_machine.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <deque>
#include <map>
#include <set>
#include <tuple>

using fsdp::detail::Event;
using fsdp::detail::GatherStatus;
using fsdp::detail::GroupState;
using fsdp::detail::next_state;
using fsdp::detail::Phase;
using fsdp::detail::ReduceStatus;
using fsdp::detail::ShardStatus;
using fsdp::detail::StateMachine;

namespace {

const Phase I = Phase::Idle, F = Phase::Forward, PB = Phase::PreBackward, PO = Phase::PostBackward;
const std::vector<Event> kPhaseEvents = {Event::PreForward, Event::PostForward, Event::PreBackward,
                                         Event::PostBackward, Event::EndBackward, Event::Reset};

// docs/fully_shard.md, "phase x event": the phase after the event, or nullopt (illegal).
std::optional<Phase> expected_phase(Phase from, Event e) {
  using O = std::optional<Phase>;
  const O no;
  //                                    PreForward PostForward PreBackward PostBackward EndBackward Reset
  static const std::map<Phase, std::vector<O>> table = {
      {I,  {O(F), no,    O(PB), no,     O(I), O(I)}},
      {F,  {no,   O(I),  no,    no,     no,   O(I)}},
      {PB, {no,   no,    no,    O(PO),  O(I), O(I)}},
      {PO, {O(F), no,    O(PB), O(PO),  O(I), O(I)}},
  };
  for (size_t k = 0; k < kPhaseEvents.size(); ++k) {
    if (kPhaseEvents[k] == e) return table.at(from)[k];
  }
  ADD_FAILURE() << "not a phase event";
  return no;
}

// docs/fully_shard.md, "data x event": (shard, gather) after the event, or nullopt.
using Data = std::pair<ShardStatus, GatherStatus>;
std::optional<Data> expected_data(const GroupState& s, Event e) {
  const ShardStatus S = ShardStatus::Sharded, SPF = ShardStatus::ShardedPostForward, U = ShardStatus::Unsharded;
  const GatherStatus none = GatherStatus::None, fly = GatherStatus::InFlight;
  const Data d{s.shard, s.gather};
  switch (e) {
    case Event::IssueGather:
      if (d == Data{S, none}) return Data{S, fly};
      if (d == Data{SPF, none}) return Data{SPF, fly};
      return std::nullopt;
    case Event::FinishGather:
      if (s.gather == fly) return Data{U, none};
      return std::nullopt;
    case Event::DropGather:
      if (s.gather == fly) return Data{s.shard, none};
      return std::nullopt;
    case Event::ShowUnshardedNoGather:
      if (s.phase == PB && s.gather == none && s.shard != U) return Data{U, none};
      return std::nullopt;
    case Event::Reshard:
      if (d == Data{U, none} || d == Data{SPF, none}) return Data{S, none};
      return std::nullopt;
    case Event::ReshardKeepPostForward:
      if (d == Data{U, none}) return Data{SPF, none};
      return std::nullopt;
    default: break;
  }
  ADD_FAILURE() << "not a data event";
  return std::nullopt;
}

std::optional<GroupState> expected(const GroupState& s, Event e) {
  GroupState n = s;
  switch (e) {
    case Event::Reset: return GroupState{};
    case Event::PreForward:
    case Event::PostForward:
    case Event::PreBackward:
    case Event::PostBackward:
    case Event::EndBackward: {
      auto p = expected_phase(s.phase, e);
      if (!p) return std::nullopt;
      n.phase = *p;
      return n;
    }
    case Event::IssueReduce:
      if (s.reduce == ReduceStatus::InFlight || s.phase == F) return std::nullopt;
      n.reduce = ReduceStatus::InFlight;
      return n;
    case Event::FinishReduce:
      if (s.reduce != ReduceStatus::InFlight) return std::nullopt;
      n.reduce = ReduceStatus::None;
      return n;
    default: {
      auto d = expected_data(s, e);
      if (!d) return std::nullopt;
      n.shard = d->first;
      n.gather = d->second;
      return n;
    }
  }
}

std::tuple<int, int, int, int> key(const GroupState& s) {
  return {static_cast<int>(s.phase), static_cast<int>(s.shard), static_cast<int>(s.gather), static_cast<int>(s.reduce)};
}

}  // namespace

TEST(FullyShardStateMachine, EveryReachableStateUnderEveryEventMatchesTheDocumentedTable) {
  std::set<std::tuple<int, int, int, int>> seen{key(GroupState{})};
  std::deque<GroupState> todo{GroupState{}};
  int legal = 0, illegal = 0;
  std::set<int> events_used;
  while (!todo.empty()) {
    const GroupState s = todo.front();
    todo.pop_front();
    for (int k = 0; k < fsdp::detail::kNumEvents; ++k) {
      const Event e = static_cast<Event>(k);
      const auto want = expected(s, e);
      const auto got = next_state(s, e);
      ASSERT_EQ(got.has_value(), want.has_value())
          << "state (" << fsdp::detail::to_string(s) << "), event '" << fsdp::detail::to_string(e) << "'";
      if (!got) {
        ++illegal;
        continue;
      }
      ASSERT_TRUE(*got == *want) << "state (" << fsdp::detail::to_string(s) << "), event '"
                                 << fsdp::detail::to_string(e) << "': got (" << fsdp::detail::to_string(*got)
                                 << "), want (" << fsdp::detail::to_string(*want) << ")";
      ++legal;
      events_used.insert(k);
      if (seen.insert(key(*got)).second) todo.push_back(*got);
    }
  }
  // 4 phases x {sharded, sharded in flight, post-forward copy, post-forward copy in flight, unsharded} x
  // {no reduction, reduction in flight}: all 40 are reachable, no other is.
  EXPECT_EQ(seen.size(), 40u);
  EXPECT_EQ(static_cast<int>(events_used.size()), fsdp::detail::kNumEvents);  // every event has a legal edge
  EXPECT_GT(legal, 200);
  EXPECT_GT(illegal, 200);
}

TEST(FullyShardStateMachine, IllegalEdgeNamesGroupStateAndEventAndChangesNothing) {
  StateMachine m("blocks.1 (Block)");
  m.apply(Event::PreForward);
  m.apply(Event::IssueGather);
  const GroupState before = m.state();
  const int64_t transitions = m.transitions();
  try {
    m.apply(Event::PreBackward);  // backward of a group still in its forward
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("blocks.1 (Block)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'pre-backward'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("forward, sharded, all-gather in flight"), std::string::npos) << msg;
  }
  EXPECT_TRUE(m.state() == before);
  EXPECT_EQ(m.transitions(), transitions);
  EXPECT_THROW(m.apply(Event::IssueGather), c10::Error);  // a second gather while one is in flight
  m.apply(Event::FinishGather);
  EXPECT_THROW(m.apply(Event::FinishGather), c10::Error);  // nothing in flight to finish
  m.apply(Event::ReshardKeepPostForward);
  EXPECT_EQ(m.shard(), ShardStatus::ShardedPostForward);
}

TEST(FullyShardStateMachine, AbandonedStepIsDecidedFromThePhase) {
  using fsdp::detail::is_abandoned;
  EXPECT_FALSE(is_abandoned(I, false));
  EXPECT_FALSE(is_abandoned(I, true));
  EXPECT_TRUE(is_abandoned(F, false));
  EXPECT_TRUE(is_abandoned(PB, false));
  EXPECT_TRUE(is_abandoned(PO, false));
  EXPECT_FALSE(is_abandoned(PB, true));
  EXPECT_FALSE(is_abandoned(PO, true));
}

// ---- the runtime --------------------------------------------------------------------------------------------

namespace {
using fsdp_test::MLP;

const fsdp::detail::StateMachine& machine_of(const fsdp::FSDPModule& unit) {
  return fsdp::detail::FSDPModuleAccess::state(unit).param_group()->state_machine();
}

std::vector<fsdp::FSDPModule> shard(MLP& model, fsdp::ReshardAfterForward raf) {
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {fsdp::world()->size()});
  opts.reshard_after_forward = raf;
  return fsdp_test::shard_mlp(model, opts);
}
}  // namespace

TEST(FullyShardStateMachine, RuntimeShowsTheDocumentedStatesThroughAStep) {
  auto world = fsdp_test::test_world();
  for (const fsdp::ReshardAfterForward raf : {fsdp::ReshardAfterForward(true), fsdp::ReshardAfterForward(false)}) {
    MLP model = fsdp_test::make_mlp(7);
    auto units = shard(model, raf);
    const bool resharding = std::get<bool>(raf);
    std::vector<std::string> inside_forward, in_backward;
    for (size_t i = 0; i < model->blocks->size(); ++i) {
      // Registered after FSDP's own hooks: runs once block i is gathered.
      fsdp::nn::register_forward_pre_hook(*model->blocks[i], [&, i](torch::nn::Module&, fsdp::nn::TensorList&) {
        inside_forward.push_back(fsdp::detail::to_string(machine_of(units[i]).state()));
      });
      fsdp::nn::register_forward_hook(*model->blocks[i], [&, i](torch::nn::Module&, const fsdp::nn::TensorList&,
                                                                fsdp::nn::TensorList& out) {
        // A gradient hook on the block's output runs after FSDP's pre-backward hook (registered first).
        out[0].register_hook([&, i](const torch::Tensor&) {
          in_backward.push_back(fsdp::detail::to_string(machine_of(units[i]).state()));
        });
      });
    }
    const int64_t before = machine_of(units[0]).transitions();
    auto x = torch::randn({4, 7});
    auto loss = fsdp::nn::call(model, x).square().mean();
    for (size_t i = 0; i < model->blocks->size(); ++i) {
      EXPECT_EQ(inside_forward.at(i), "forward, unsharded");
      const auto& s = machine_of(units[i]).state();
      EXPECT_EQ(s.phase, Phase::Idle);
      EXPECT_EQ(s.shard, resharding ? ShardStatus::Sharded : ShardStatus::Unsharded) << i;
    }
    loss.backward();
    ASSERT_EQ(in_backward.size(), model->blocks->size());
    for (const auto& s : in_backward) EXPECT_EQ(s, "pre-backward, unsharded");
    for (const auto& u : units) {
      EXPECT_TRUE(machine_of(u).state() == GroupState{}) << fsdp::detail::to_string(machine_of(u).state());
    }
    EXPECT_GT(machine_of(units[0]).transitions(), before + 5);  // the machine ran: phases, gathers, reduce

    // Explicit unshard: a gather in flight until waited; reshard returns to the start.
    auto handle = units[0].unshard(/*async_op=*/true);
    if (world->size() > 1) EXPECT_TRUE(machine_of(units[0]).gather_in_flight());
    handle.wait();
    EXPECT_EQ(machine_of(units[0]).shard(), ShardStatus::Unsharded);
    units[0].reshard();
    EXPECT_TRUE(machine_of(units[0]).state() == GroupState{});
  }
}

TEST(FullyShardStateMachine, PostForwardCopyOfReshardAfterForwardN) {
  auto world = fsdp_test::test_world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks (N = 2 divides 4)";
  MLP model = fsdp_test::make_mlp(8);
  auto units = shard(model, fsdp::ReshardAfterForward(2));
  auto loss = fsdp::nn::call(model, torch::randn({4, 7})).sum();
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    EXPECT_EQ(machine_of(units[i]).shard(), ShardStatus::ShardedPostForward) << i;
  }
  loss.backward();
  for (size_t i = 0; i < model->blocks->size(); ++i) EXPECT_TRUE(machine_of(units[i]).state() == GroupState{});
}
