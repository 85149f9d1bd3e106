// Simulation: an event replay of the lowered lists (each rank runs its list in order; a RECV's data arrives after
// its SEND), shared by validate_lowered's dry run (no costs: does it finish?) and simulate() (costs: when does
// each action run, how much of the makespan is bubble).
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <unordered_map>

namespace fsdp::pipeline {
namespace detail {

// The send an incoming transfer matches: (sender stage, SEND type, microbatch).
Action matching_send(const Action& recv) {
  if (recv.type == ActionType::RecvF) return Action{recv.stage - 1, ActionType::SendF, recv.microbatch};
  return Action{recv.stage + 1, ActionType::SendB, recv.microbatch};
}

ReplayTimes replay(const ActionLists& lists, const std::vector<int>& stage_to_rank, const ReplayOptions& options) {
  const int pp = static_cast<int>(lists.size());
  const int num_stages = static_cast<int>(stage_to_rank.size());
  std::vector<size_t> next(pp, 0);
  std::vector<std::unordered_map<ActionKey, double>> done(pp);  // per rank: action -> time its data is available
  std::unordered_map<ActionKey, double> issued_sends;            // SEND -> issue time
  ReplayTimes times;
  times.clock.assign(pp, 0.0);
  times.busy.assign(pp, 0.0);
  times.spans.resize(pp);
  const double latency = options.costs ? options.costs->p2p_latency : 0.0;

  auto fail = [&](int rank, const std::string& what) {
    TORCH_CHECK(false, error_with_grid("validate_lowered", "rank " + std::to_string(rank) + ", step " +
                                                               std::to_string(next[rank]) + " (" +
                                                               lists[rank][next[rank]].str() + "): " + what,
                                       as_grid(lists), static_cast<int>(next[rank])));
  };
  // Time at which the input of a compute / send action is available on `rank`, or fail if it never will be.
  auto input_ready_at = [&](int rank, const Action& a) -> double {
    auto find_local = [&](std::initializer_list<Action> candidates) -> std::optional<double> {
      for (const Action& c : candidates) {
        auto it = done[rank].find(key_of(c));
        if (it != done[rank].end()) return it->second;
      }
      return std::nullopt;
    };
    std::optional<double> ready;
    switch (a.type) {
      case ActionType::Forward:
        if (a.stage == 0) return 0.0;
        ready = stage_to_rank[a.stage - 1] == rank
                    ? find_local({Action{a.stage - 1, ActionType::Forward, a.microbatch}})
                    : find_local({Action{a.stage, ActionType::RecvF, a.microbatch}});
        if (!ready) fail(rank, "computes before its input is received or produced on this rank");
        return *ready;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        if (a.stage == num_stages - 1) {
          ready = find_local({Action{a.stage, ActionType::Forward, a.microbatch}});
        } else if (stage_to_rank[a.stage + 1] == rank) {
          ready = find_local({Action{a.stage + 1, ActionType::Backward, a.microbatch},
                              Action{a.stage + 1, ActionType::BackwardInput, a.microbatch}});
        } else {
          ready = find_local({Action{a.stage, ActionType::RecvB, a.microbatch}});
        }
        if (!ready) fail(rank, "computes before its gradient input is received or produced on this rank");
        return *ready;
      case ActionType::BackwardWeight:
        ready = find_local({Action{a.stage, ActionType::BackwardInput, a.microbatch}});
        if (!ready) fail(rank, "runs before the I of the same stage and microbatch");
        return *ready;
      case ActionType::SendF:
        ready = find_local({Action{a.stage, ActionType::Forward, a.microbatch}});
        if (!ready) fail(rank, "sends an activation that this rank has not computed yet");
        return *ready;
      case ActionType::SendB:
        ready = find_local({Action{a.stage, ActionType::Backward, a.microbatch},
                            Action{a.stage, ActionType::BackwardInput, a.microbatch}});
        if (!ready) fail(rank, "sends a gradient that this rank has not computed yet");
        return *ready;
      default:
        return 0.0;
    }
  };

  while (true) {
    bool all_done = true, progress = false;
    for (int rank = 0; rank < pp; ++rank) {
      while (next[rank] < lists[rank].size()) {
        const Action& a = lists[rank][next[rank]];
        double& clock = times.clock[rank];
        double start = clock, end = clock, available = clock;
        if (is_recv(a.type)) {
          auto send = issued_sends.find(key_of(matching_send(a)));
          if (send == issued_sends.end()) break;  // blocks until the peer issues the SEND
          available = std::max(clock, send->second + latency);
          if (options.recv_blocks_rank) start = end = clock = available;
        } else if (is_compute(a.type)) {
          // An OVERLAP_F_B runs its parts one after the other (as the runtime does), each when its input is there.
          bool first = true;
          for (const Action& leaf : a.leaves()) {
            const double leaf_start = std::max(clock, input_ready_at(rank, leaf));
            if (first) start = leaf_start;
            first = false;
            clock = leaf_start + (options.costs ? options.costs->cost_of(leaf) : 0.0);
            times.busy[rank] += clock - leaf_start;
            done[rank][key_of(leaf)] = clock;
          }
          end = available = clock;
        } else if (is_send(a.type)) {
          available = std::max(clock, input_ready_at(rank, a));
          issued_sends[key_of(a)] = available;
        } else {  // UNSHARD / RESHARD / REDUCE_GRAD occupy the rank
          end = clock = clock + (options.costs ? options.costs->cost_of(a) : 0.0);
          available = end;
        }
        done[rank][key_of(a)] = available;
        times.spans[rank].emplace_back(start, end);
        ++next[rank];
        progress = true;
      }
      if (next[rank] < lists[rank].size()) all_done = false;
    }
    if (all_done) break;
    if (!progress) {
      std::ostringstream blocked;
      for (int rank = 0; rank < pp; ++rank) {
        if (next[rank] >= lists[rank].size()) continue;
        const Action& a = lists[rank][next[rank]];
        const Action send = matching_send(a);
        blocked << "\n  rank " << rank << " step " << next[rank] << ": " << a.str() << " waits for " << send.str()
                << " on rank " << stage_to_rank[send.stage];
      }
      TORCH_CHECK(false, "validate_lowered: the schedule deadlocks; every unfinished rank waits on a RECV whose SEND "
                         "is never issued:",
                  blocked.str(), "\n\nFull pipeline schedule:\n", format_grid(as_grid(lists)));
    }
  }
  return times;
}

}  // namespace detail

double SimCosts::cost_of(const Action& action) const {
  double base = 0.0;
  switch (action.type) {
    case ActionType::Forward: base = forward; break;
    case ActionType::Backward: base = backward; break;
    case ActionType::BackwardInput: base = backward_input; break;
    case ActionType::BackwardWeight: base = backward_weight; break;
    case ActionType::Unshard: return unshard;
    case ActionType::Reshard: return reshard;
    case ActionType::ReduceGrad: return reduce_grad;
    case ActionType::OverlapFB: {
      double sum = 0.0;
      for (const Action& part : action.sub_actions) sum += cost_of(part);
      return sum;
    }
    default: return 0.0;
  }
  if (stage_scale.empty()) return base;
  TORCH_CHECK(action.stage >= 0 && action.stage < static_cast<int>(stage_scale.size()), "SimCosts: stage_scale has ",
              stage_scale.size(), " entries, no scale for stage ", action.stage);
  return base * stage_scale[action.stage];
}

SimResult simulate(const PipelineSchedule& schedule, const SimCosts& costs) {
  TORCH_CHECK(costs.stage_scale.empty() || static_cast<int>(costs.stage_scale.size()) == schedule.num_stages,
              "simulate: SimCosts::stage_scale has ", costs.stage_scale.size(), " entries, expected one per stage (",
              schedule.num_stages, ")");
  // A hand-edited schedule gets the validator's clear errors rather than a replay of nonsense.
  validate_lowered(schedule.actions, schedule.stage_to_rank, schedule.spec.microbatches);
  // torch's runtime posts a RECV without waiting and waits for it right before the compute that consumes it, so
  // by default the wait is charged to the consumer: an early RECV in the list does not stall unrelated work.
  detail::ReplayOptions options;
  options.costs = &costs;
  options.recv_blocks_rank = costs.recv_waits_in_place;
  const detail::ReplayTimes times = detail::replay(schedule.actions, schedule.stage_to_rank, options);
  SimResult result;
  result.spans = times.spans;
  result.busy = times.busy;
  for (double clock : times.clock) result.makespan = std::max(result.makespan, clock);
  double idle_total = 0.0;
  for (double busy : times.busy) {
    result.idle.push_back(result.makespan - busy);
    idle_total += result.makespan - busy;
  }
  const double total = result.makespan * static_cast<double>(times.clock.size());
  result.bubble_fraction = total > 0.0 ? idle_total / total : 0.0;
  return result;
}

}  // namespace fsdp::pipeline
