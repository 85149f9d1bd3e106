#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace fsdp::pipeline {
namespace {

struct TypeToken {
  ActionType type;
  const char* token;
};
// Longest tokens first so that parsing "SEND_F" never stops at a shorter prefix.
constexpr std::array<TypeToken, 11> kTypeTokens{{{ActionType::ReduceGrad, "REDUCE_GRAD"},
                                                 {ActionType::Unshard, "UNSHARD"},
                                                 {ActionType::Reshard, "RESHARD"},
                                                 {ActionType::SendF, "SEND_F"},
                                                 {ActionType::RecvF, "RECV_F"},
                                                 {ActionType::SendB, "SEND_B"},
                                                 {ActionType::RecvB, "RECV_B"},
                                                 {ActionType::Forward, "F"},
                                                 {ActionType::Backward, "B"},
                                                 {ActionType::BackwardInput, "I"},
                                                 {ActionType::BackwardWeight, "W"}}};

bool is_stage_wide(ActionType type) {
  return type == ActionType::Unshard || type == ActionType::Reshard || type == ActionType::ReduceGrad;
}

bool is_backward_like(ActionType type) {  // produces the gradient sent upstream
  return type == ActionType::Backward || type == ActionType::BackwardInput;
}

bool finishes_weight_grad(ActionType type) {  // what REDUCE_GRAD waits for (torch: B or W)
  return type == ActionType::Backward || type == ActionType::BackwardWeight;
}

// A hashable identity for an action (sets of "already happened" actions). Unsigned arithmetic: a nonsense stage
// number in a hand-made list must not overflow before validation reports it.
using ActionKey = uint64_t;
ActionKey key_of(int stage, ActionType type, int microbatch) {
  return (static_cast<ActionKey>(static_cast<uint32_t>(stage)) * 16 + static_cast<ActionKey>(type)) << 32 |
         static_cast<uint32_t>(microbatch + 1);
}
ActionKey key_of(const Action& a) { return key_of(a.stage, a.type, a.microbatch); }

std::string lower_case(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

constexpr std::array<ScheduleKind, 6> kAllKinds{ScheduleKind::GPipe,
                                                ScheduleKind::OneFOneB,
                                                ScheduleKind::LoopedBFS,
                                                ScheduleKind::Interleaved1F1B,
                                                ScheduleKind::InterleavedZeroBubble,
                                                ScheduleKind::ZBVZeroBubble};

// ---------------------------------------------------------------------------------------------------------------
// Generators. Each returns the compute-only list of one rank, nullopt for an idle step, exactly as torch 2.13's
// schedule classes build pipeline_order (GPipe / 1F1B: the order their runtime loops execute).

using RankList = std::vector<std::optional<Action>>;

// GPipe's runtime loop: every forward in microbatch order, then every backward in microbatch order.
RankList gpipe_rank(int rank, int microbatches) {
  RankList ops;
  for (int mb = 0; mb < microbatches; ++mb) ops.push_back(Action{rank, ActionType::Forward, mb});
  for (int mb = 0; mb < microbatches; ++mb) ops.push_back(Action{rank, ActionType::Backward, mb});
  return ops;
}

// Schedule1F1B._step_microbatches: min(m, p - s) warm-up forwards, then backward/forward pairs until the forwards
// run out, then the remaining backwards. (torch's Schedule1F1B._get_pipeline_order is off by one on the last rank
// and is deliberately not what this follows.)
RankList one_f_one_b_rank(int rank, int pp, int microbatches) {
  RankList ops;
  const int warmup = std::min(microbatches, pp - rank);
  int next_forward = 0;
  int next_backward = 0;
  while (next_forward < warmup) ops.push_back(Action{rank, ActionType::Forward, next_forward++});
  while (true) {
    ops.push_back(Action{rank, ActionType::Backward, next_backward++});
    if (next_forward == microbatches) break;
    ops.push_back(Action{rank, ActionType::Forward, next_forward++});
  }
  while (next_backward < microbatches) ops.push_back(Action{rank, ActionType::Backward, next_backward++});
  return ops;
}

// ScheduleLoopedBFS: all forwards of the first local stage, then of the next, ...; backwards in reverse stage
// order with microbatches reversed. The idle steps model the fill (rank) and the wait for the first backward.
RankList looped_bfs_rank(int rank, int pp, int stages_per_rank, int microbatches) {
  RankList ops(static_cast<size_t>(rank));
  for (int local = 0; local < stages_per_rank; ++local)
    for (int mb = 0; mb < microbatches; ++mb) ops.push_back(Action{rank + local * pp, ActionType::Forward, mb});
  ops.resize(ops.size() + static_cast<size_t>(2 * (pp - 1 - rank)));
  for (int local = stages_per_rank - 1; local >= 0; --local)
    for (int mb = microbatches - 1; mb >= 0; --mb)
      ops.push_back(Action{rank + local * pp, ActionType::Backward, mb});
  return ops;
}

// The interleaved generator shared by Interleaved1F1B and InterleavedZeroBubble (torch's _get_1f1b_rank_ops).
// Steps are numbered over the rank's v*m forwards; a step's stage cycles over the local stages every
// microbatches_per_round steps (forwards ascending, backwards descending from the end of the warm-up).
RankList interleaved_rank(int rank, int pp, int stages_per_rank, int microbatches, bool zero_bubble) {
  const int rounds = std::max(1, microbatches / pp);
  const int per_round = microbatches / rounds;
  const int warmup_factor = zero_bubble ? 1 : 2;  // hops to the last rank and back (1F1B) or one way (ZB)
  const int total_forwards = stages_per_rank * microbatches;
  const int warmup =
      std::min((stages_per_rank - 1) * per_round + warmup_factor * (pp - 1 - rank), total_forwards);
  const int steady = total_forwards - warmup;  // steps with one forward and one backward
  const int cooldown = warmup;                 // steps with only a backward
  // Idle steps after the warm-up so that the first backward lines up across ranks.
  const int post_warmup_idle =
      zero_bubble ? pp - rank - 1 : stages_per_rank * pp + 2 * (pp - 1 - rank) - (warmup + rank);
  // A rank's zero-bubble W trails its I by `rank` microbatches (ZB1P): the first W comes after rank + 1 Is.
  const int weights_deferred_by = rank;

  auto forward_stage = [&](int step) { return ((step / per_round) % stages_per_rank) * pp + rank; };
  auto backward_stage = [&](int step) {
    return (stages_per_rank - 1 - ((step - warmup) / per_round) % stages_per_rank) * pp + rank;
  };
  const ActionType backward_type = zero_bubble ? ActionType::BackwardInput : ActionType::Backward;

  std::map<int, int> next_forward_mb, next_backward_mb, next_weight_mb;  // per stage
  std::vector<int> backward_steps;                                       // step of each backward, in order
  size_t weights_done = 0;
  RankList ops(static_cast<size_t>(rank));
  auto add_weight = [&]() {
    const int stage = backward_stage(backward_steps[weights_done++]);
    ops.push_back(Action{stage, ActionType::BackwardWeight, next_weight_mb[stage]++});
  };
  auto add_backward = [&](int step) {
    const int stage = backward_stage(step);
    ops.push_back(Action{stage, backward_type, next_backward_mb[stage]++});
    backward_steps.push_back(step);
    if (zero_bubble && step - warmup >= weights_deferred_by) add_weight();
  };
  for (int step = 0; step < warmup + steady + cooldown; ++step) {
    if (step < warmup + steady) {
      const int stage = forward_stage(step);
      ops.push_back(Action{stage, ActionType::Forward, next_forward_mb[stage]++});
      if (step == warmup - 1) ops.resize(ops.size() + static_cast<size_t>(std::max(0, post_warmup_idle)));
      if (step >= warmup) add_backward(step);
    } else {
      if (!zero_bubble) ops.emplace_back(std::nullopt);  // keeps cooldown steps aligned with 1F1B elsewhere
      add_backward(step);
    }
  }
  while (zero_bubble && weights_done < backward_steps.size()) add_weight();
  return ops;
}

// InterleavedZeroBubble's _add_bubbles_to_actions: walk all ranks in lock step and insert an idle step where a
// forward's previous stage has not run in an earlier step. (torch also tests full backwards here, but this
// schedule has none — its I actions are not delayed, so the same holds here.)
ComputeGrid add_zero_bubble_idle_steps(const ComputeGrid& lists) {
  ComputeGrid result(lists.size());
  std::vector<size_t> next(lists.size(), 0);
  std::unordered_set<ActionKey> seen;
  while (true) {
    bool any_left = false;
    std::vector<ActionKey> seen_this_step;
    for (size_t rank = 0; rank < lists.size(); ++rank) {
      if (next[rank] >= lists[rank].size()) continue;
      any_left = true;
      const auto& action = lists[rank][next[rank]];
      if (!action) {
        result[rank].emplace_back(std::nullopt);
        ++next[rank];
        continue;
      }
      const bool waits = action->type == ActionType::Forward && action->stage != 0 &&
                         !seen.count(key_of(action->stage - 1, ActionType::Forward, action->microbatch));
      if (waits) {
        result[rank].emplace_back(std::nullopt);
      } else {
        result[rank].push_back(action);
        seen_this_step.push_back(key_of(*action));
        ++next[rank];
      }
    }
    seen.insert(seen_this_step.begin(), seen_this_step.end());
    if (!any_left) break;
  }
  return result;
}

// ScheduleZBVZeroBubble: chunk 0 is stage `rank` (down the V), chunk 1 is stage 2p-1-rank (back up). It plans
// max(2p-1, m) microbatches so that the pattern is complete and then blanks those >= m.
RankList zbv_rank(int rank, int pp, int microbatches) {
  const int planned = std::max(2 * pp - 1, microbatches);
  const int chunk0 = rank;
  const int chunk1 = 2 * pp - 1 - rank;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  RankList ops(static_cast<size_t>(rank));
  auto add = [&](int stage, ActionType type, int mb) { ops.push_back(Action{stage, type, mb}); };
  for (int i = 0; i < 2 * (pp - rank) - 1; ++i) add(chunk0, ActionType::Forward, f0++);
  for (int i = 0; i < rank; ++i) {
    add(chunk1, ActionType::Forward, f1++);
    add(chunk0, ActionType::Forward, f0++);
  }
  for (int i = 0; i < pp - rank; ++i) {
    add(chunk1, ActionType::Forward, f1++);
    add(chunk1, ActionType::BackwardInput, b1);
    add(chunk1, ActionType::BackwardWeight, b1++);
  }
  while (f1 < f0 || f0 < planned) {  // steady: F0 I0 W0 F1 I1 W1
    if (f0 < planned) add(chunk0, ActionType::Forward, f0++);
    add(chunk0, ActionType::BackwardInput, b0);
    add(chunk0, ActionType::BackwardWeight, b0++);
    add(chunk1, ActionType::Forward, f1++);
    add(chunk1, ActionType::BackwardInput, b1);
    add(chunk1, ActionType::BackwardWeight, b1++);
  }
  int w0 = b0, w1 = b1;
  for (int i = 0; i < rank; ++i) {
    add(chunk0, ActionType::BackwardInput, b0++);
    add(chunk1, ActionType::BackwardInput, b1++);
  }
  for (int i = 0; i < pp - rank; ++i) {
    add(chunk0, ActionType::BackwardInput, b0++);
    add(chunk0, ActionType::BackwardWeight, w0++);
  }
  while (w1 < b1) add(chunk1, ActionType::BackwardWeight, w1++);
  while (w0 < b0) add(chunk0, ActionType::BackwardWeight, w0++);
  TORCH_CHECK(w0 == b0 && b0 == f0 && w1 == b1 && b1 == f1, "ZBV generator on rank ", rank,
              " is unbalanced (internal error): F/I/W counts ", f0, "/", b0, "/", w0, " and ", f1, "/", b1, "/",
              w1);
  for (auto& action : ops)
    if (action && action->microbatch >= microbatches) action.reset();
  return ops;
}

// Idle steps for the single-stage schedules' compute grids (display only; their lowering ignores them): one step
// per action, placed at the first step after its producer on the neighbour rank finished.
ComputeGrid space_by_dependencies(const ComputeGrid& dense, int num_stages) {
  ComputeGrid spaced(dense.size());
  std::vector<size_t> next(dense.size(), 0);
  std::unordered_set<ActionKey> done;
  auto producer_done = [&](const Action& a) {
    switch (a.type) {
      case ActionType::Forward:
        return a.stage == 0 || done.count(key_of(a.stage - 1, ActionType::Forward, a.microbatch)) > 0;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        return a.stage == num_stages - 1 ||
               done.count(key_of(a.stage + 1, ActionType::Backward, a.microbatch)) > 0 ||
               done.count(key_of(a.stage + 1, ActionType::BackwardInput, a.microbatch)) > 0;
      default:
        return true;
    }
  };
  while (true) {
    bool any_left = false, placed = false;
    std::vector<ActionKey> done_this_step;
    for (size_t rank = 0; rank < dense.size(); ++rank) {
      if (next[rank] >= dense[rank].size()) continue;
      any_left = true;
      const auto& action = dense[rank][next[rank]];
      if (!action || producer_done(*action)) {
        spaced[rank].push_back(action);
        if (action) done_this_step.push_back(key_of(*action));
        ++next[rank];
        placed = true;
      } else {
        spaced[rank].emplace_back(std::nullopt);
      }
    }
    if (!any_left) break;
    TORCH_CHECK(placed, "space_by_dependencies: no rank can make progress (internal error)\n", format_grid(dense));
    done.insert(done_this_step.begin(), done_this_step.end());
  }
  return spaced;
}

// GPipe / 1F1B lowering: the P2P ops where their runtime loops issue them. A receive directly precedes its
// consumer; a send directly follows its producer (1F1B batches the send of one step with the receive of the next,
// issued send first, which this order keeps). One stage per rank, unsharded for the whole step, its gradients
// reduced once after the last backward (perform_reduce_grad after the loop).
std::vector<Action> lower_single_stage_rank(const std::vector<std::optional<Action>>& compute, int stage,
                                            int num_stages) {
  std::vector<Action> out;
  out.push_back(Action{stage, ActionType::Unshard, -1});
  for (const auto& slot : compute) {
    if (!slot) continue;
    const Action& a = *slot;
    const bool forward = a.type == ActionType::Forward;
    const bool receives = forward ? stage > 0 : stage < num_stages - 1;
    const bool sends = forward ? stage < num_stages - 1 : stage > 0;
    if (receives) out.push_back(Action{stage, forward ? ActionType::RecvF : ActionType::RecvB, a.microbatch});
    out.push_back(a);
    if (sends) out.push_back(Action{stage, forward ? ActionType::SendF : ActionType::SendB, a.microbatch});
  }
  out.push_back(Action{stage, ActionType::ReduceGrad, -1});
  out.push_back(Action{stage, ActionType::Reshard, -1});
  return out;
}

std::string error_with_grid(const std::string& where, const std::string& what, const ComputeGrid& grid,
                            int step) {
  return where + ": " + what + "\n\nFull pipeline schedule:\n" + format_grid(grid, step);
}

// validate_lowered's error for action `a` at `step` of `rank`'s list, with the grid marked there.
[[noreturn]] void fail_lowered_at(const ComputeGrid& grid, int rank, int step, const Action& a,
                                  const std::string& what) {
  TORCH_CHECK(false, error_with_grid("validate_lowered",
                                     "rank " + std::to_string(rank) + ", step " + std::to_string(step) + " (" +
                                         a.str() + "): " + what,
                                     grid, step));
}

ComputeGrid as_grid(const ActionLists& lists) {
  ComputeGrid grid(lists.size());
  for (size_t r = 0; r < lists.size(); ++r) grid[r].assign(lists[r].begin(), lists[r].end());
  return grid;
}

// ---------------------------------------------------------------------------------------------------------------
// Replay of lowered lists: validate_lowered's dry run and simulate() share it. Each rank executes its list in
// order. A RECV cannot be processed before its matching SEND was issued (that is the only wait); everything else a
// rank reaches must already have its inputs on that rank, or the list is wrong.

struct ReplayOptions {
  const SimCosts* costs = nullptr;  // null: dry run only
  bool recv_blocks_rank = false;    // time model: the RECV itself waits (true) or the consumer does (false)
};

struct ReplayTimes {
  std::vector<double> clock;
  std::vector<std::vector<std::pair<double, double>>> spans;
  std::vector<double> busy;
};

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
          start = std::max(clock, input_ready_at(rank, a));
          end = start + (options.costs ? options.costs->cost_of(a) : 0.0);
          clock = end;
          available = end;
          times.busy[rank] += end - start;
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

void check_spec(const ScheduleSpec& spec) {
  const std::string name = schedule_name(spec.kind);
  TORCH_CHECK(spec.pp >= 1, name, ": pp (pipeline ranks) must be >= 1, got ", spec.pp);
  TORCH_CHECK(spec.microbatches >= 1, name, ": microbatches must be >= 1, got ", spec.microbatches);
  TORCH_CHECK(spec.stages_per_rank >= 1, name, ": stages_per_rank must be >= 1, got ", spec.stages_per_rank);
  // Guards against a typo allocating forever: a real schedule is far below this many actions.
  const double actions = 3.0 * spec.pp * spec.stages_per_rank * spec.microbatches;  // no integer overflow
  TORCH_CHECK(actions <= 1e7, name, ": pp ", spec.pp, " x stages_per_rank ", spec.stages_per_rank,
              " x microbatches ", spec.microbatches, " is implausibly large (", actions, " compute actions)");
  switch (spec.kind) {
    case ScheduleKind::GPipe:
    case ScheduleKind::OneFOneB:
      TORCH_CHECK(spec.stages_per_rank == 1, name,
                  " runs exactly one stage per rank (torch's PipelineScheduleSingle), got stages_per_rank=",
                  spec.stages_per_rank, "; use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble for more");
      if (spec.kind == ScheduleKind::OneFOneB)
        TORCH_CHECK(spec.microbatches >= spec.pp, "1F1B needs at least as many microbatches as stages: got ",
                    spec.microbatches, " microbatches for ", spec.pp, " stages");
      break;
    case ScheduleKind::ZBVZeroBubble:
      TORCH_CHECK(spec.stages_per_rank == 2, "ZBVZeroBubble requires exactly 2 stages per rank (the V), got ",
                  spec.stages_per_rank);
      break;
    case ScheduleKind::Interleaved1F1B:
    case ScheduleKind::InterleavedZeroBubble: {
      const int rounds = std::max(1, spec.microbatches / spec.pp);
      TORCH_CHECK(spec.microbatches % rounds == 0, name,
                  " requires the number of microbatches to be a multiple of the number of rounds (max(1, m / pp) = ",
                  rounds, "), got m=", spec.microbatches, " with pp=", spec.pp);
      break;
    }
    case ScheduleKind::LoopedBFS:
      break;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Actions and names

const char* action_type_token(ActionType type) {
  for (const auto& t : kTypeTokens)
    if (t.type == type) return t.token;
  TORCH_CHECK(false, "unknown ActionType ", static_cast<int>(type));
}

bool is_compute(ActionType type) {
  return type == ActionType::Forward || type == ActionType::Backward || type == ActionType::BackwardInput ||
         type == ActionType::BackwardWeight;
}
bool is_send(ActionType type) { return type == ActionType::SendF || type == ActionType::SendB; }
bool is_recv(ActionType type) { return type == ActionType::RecvF || type == ActionType::RecvB; }

std::string Action::str() const {
  std::string out = std::to_string(stage) + action_type_token(type);
  if (!is_stage_wide(type)) out += std::to_string(microbatch);
  return out;
}

Action Action::parse(const std::string& text) {
  auto bad = [&](const std::string& why) {
    TORCH_CHECK(false, "Action::parse: invalid action \"", text, "\": ", why,
                "; expected <stage><type><microbatch> such as 2F0, 1B3, 0I1, 0W1, 3SEND_F1, 2RECV_B0, or "
                "<stage><type> for UNSHARD, RESHARD, REDUCE_GRAD (e.g. 1UNSHARD)");
  };
  size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  if (pos == 0) bad("it does not start with a stage number");
  if (pos > 9) bad("the stage number is too large");
  const int stage = std::stoi(text.substr(0, pos));
  const auto* token = std::find_if(kTypeTokens.begin(), kTypeTokens.end(), [&](const TypeToken& t) {
    return text.compare(pos, std::char_traits<char>::length(t.token), t.token) == 0;
  });
  if (token == kTypeTokens.end()) bad("unknown action type after the stage number");
  pos += std::char_traits<char>::length(token->token);
  const std::string rest = text.substr(pos);
  if (is_stage_wide(token->type)) {
    if (!rest.empty()) bad(std::string(token->token) + " takes no microbatch");
    return Action{stage, token->type, -1};
  }
  if (rest.empty()) bad(std::string(token->token) + " needs a microbatch number");
  if (rest.size() > 9 || !std::all_of(rest.begin(), rest.end(), [](char c) {
        return std::isdigit(static_cast<unsigned char>(c));
      }))
    bad("the microbatch is not a number");
  return Action{stage, token->type, std::stoi(rest)};
}

ScheduleKind parse_schedule_name(const std::string& name) {
  for (ScheduleKind kind : kAllKinds)
    if (lower_case(schedule_name(kind)) == lower_case(name)) return kind;
  std::string valid;
  for (ScheduleKind kind : kAllKinds) valid += (valid.empty() ? "" : ", ") + schedule_name(kind);
  TORCH_CHECK(false, "unknown pipeline schedule \"", name, "\"; valid names (case-insensitive): ", valid);
}

std::string schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "GPipe";
    case ScheduleKind::OneFOneB: return "1F1B";
    case ScheduleKind::LoopedBFS: return "LoopedBFS";
    case ScheduleKind::Interleaved1F1B: return "Interleaved1F1B";
    case ScheduleKind::InterleavedZeroBubble: return "InterleavedZeroBubble";
    case ScheduleKind::ZBVZeroBubble: return "ZBVZeroBubble";
  }
  TORCH_CHECK(false, "unknown ScheduleKind ", static_cast<int>(kind));
}

int default_stages_per_rank(ScheduleKind kind) { return is_single_stage_kind(kind) ? 1 : 2; }

bool is_single_stage_kind(ScheduleKind kind) {
  return kind == ScheduleKind::GPipe || kind == ScheduleKind::OneFOneB;
}

std::vector<int> PipelineSchedule::stages_of_rank(int rank) const {
  std::vector<int> stages;
  for (int s = 0; s < static_cast<int>(stage_to_rank.size()); ++s)
    if (stage_to_rank[s] == rank) stages.push_back(s);
  return stages;
}

std::vector<int> loop_stage_to_rank(int pp, int num_stages) {
  TORCH_CHECK(pp >= 1 && num_stages >= 1, "loop_stage_to_rank: pp and num_stages must be >= 1, got ", pp, ", ",
              num_stages);
  std::vector<int> map(num_stages);
  for (int s = 0; s < num_stages; ++s) map[s] = s % pp;
  return map;
}

std::vector<int> v_stage_to_rank(int pp, int num_stages) {
  TORCH_CHECK(pp >= 1 && num_stages >= 1 && num_stages % pp == 0,
              "v_stage_to_rank: num_stages must be a positive multiple of pp for a V schedule, got num_stages=",
              num_stages, " pp=", pp);
  std::vector<int> map(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    const int within = s % pp;
    map[s] = (s / pp) % 2 == 0 ? within : pp - 1 - within;  // down the V, then back up
  }
  return map;
}

// ---------------------------------------------------------------------------------------------------------------
// Validation

std::vector<int> validate_compute(const ComputeGrid& compute, int pp, int num_stages, int microbatches) {
  TORCH_CHECK(static_cast<int>(compute.size()) == pp, "validate_compute: the schedule has ", compute.size(),
              " rank lists, expected pp=", pp);
  TORCH_CHECK(num_stages >= 1 && microbatches >= 1, "validate_compute: num_stages and microbatches must be >= 1");
  std::vector<int> stage_to_rank(num_stages, -1);
  // Per stage and microbatch: which of F, B, I, W have run.
  enum Seen : unsigned { kF = 1, kB = 2, kI = 4, kW = 8 };
  std::vector<std::vector<unsigned>> seen(num_stages, std::vector<unsigned>(microbatches, 0));
  for (int rank = 0; rank < pp; ++rank) {
    for (int step = 0; step < static_cast<int>(compute[rank].size()); ++step) {
      if (!compute[rank][step]) continue;
      const Action& a = *compute[rank][step];
      auto fail = [&](const std::string& what) {
        TORCH_CHECK(false, error_with_grid("validate_compute",
                                           "rank " + std::to_string(rank) + ", step " + std::to_string(step) +
                                               " (" + a.str() + "): " + what,
                                           compute, step));
      };
      if (!is_compute(a.type)) fail("not a compute action (F, B, I or W)");
      if (a.stage < 0 || a.stage >= num_stages)
        fail("stage out of range [0, " + std::to_string(num_stages) + ")");
      if (a.microbatch < 0 || a.microbatch >= microbatches)
        fail("microbatch out of range [0, " + std::to_string(microbatches) + ")");
      if (stage_to_rank[a.stage] == -1) {
        stage_to_rank[a.stage] = rank;
      } else if (stage_to_rank[a.stage] != rank) {
        fail("stage " + std::to_string(a.stage) + " is assigned to both rank " + std::to_string(rank) +
             " and rank " + std::to_string(stage_to_rank[a.stage]));
      }
      unsigned& s = seen[a.stage][a.microbatch];
      switch (a.type) {
        case ActionType::Forward:
          if (s & kF) fail("a second Forward of the same stage and microbatch");
          s |= kF;
          break;
        case ActionType::Backward:
          if (!(s & kF)) fail("Full Backward without first running Forward");
          if (s & (kB | kI)) fail("a second backward of the same stage and microbatch");
          s |= kB;
          break;
        case ActionType::BackwardInput:
          if (!(s & kF)) fail("Backward Input without first running Forward");
          if (s & (kB | kI)) fail("a second backward of the same stage and microbatch");
          s |= kI;
          break;
        case ActionType::BackwardWeight:
          if (!(s & kI)) fail("Backward Weight without first running Backward Input");
          if (s & kW) fail("a second Backward Weight of the same stage and microbatch");
          s |= kW;
          break;
        default:
          break;
      }
    }
  }
  for (int stage = 0; stage < num_stages; ++stage) {
    TORCH_CHECK(stage_to_rank[stage] != -1,
                error_with_grid("validate_compute", "stage " + std::to_string(stage) + " appears on no rank",
                                compute, -1));
    for (int mb = 0; mb < microbatches; ++mb) {
      const unsigned s = seen[stage][mb];
      std::string missing;
      if (!(s & kF)) missing = "no Forward";
      else if (!(s & (kB | kI))) missing = "no backward (B, or I and W)";
      else if ((s & kI) && !(s & kW)) missing = "a Backward Input but no Backward Weight";
      TORCH_CHECK(missing.empty(),
                  error_with_grid("validate_compute",
                                  "stage " + std::to_string(stage) + " (rank " +
                                      std::to_string(stage_to_rank[stage]) + "), microbatch " + std::to_string(mb) +
                                      " has " + missing,
                                  compute, -1));
    }
  }
  return stage_to_rank;
}

void validate_lowered(const ActionLists& actions, const std::vector<int>& stage_to_rank, int microbatches) {
  const int pp = static_cast<int>(actions.size());
  const int num_stages = static_cast<int>(stage_to_rank.size());
  TORCH_CHECK(pp >= 1 && num_stages >= 1 && microbatches >= 1,
              "validate_lowered: need at least one rank, stage and microbatch");
  for (int s = 0; s < num_stages; ++s)
    TORCH_CHECK(stage_to_rank[s] >= 0 && stage_to_rank[s] < pp, "validate_lowered: stage ", s, " maps to rank ",
                stage_to_rank[s], ", outside [0, ", pp, ")");
  const ComputeGrid grid = as_grid(actions);

  // Per action: ownership, ranges and neighbours.
  for (int rank = 0; rank < pp; ++rank) {
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      auto fail = [&](const std::string& what) { fail_lowered_at(grid, rank, step, a, what); };
      if (a.stage < 0 || a.stage >= num_stages) fail("stage out of range");
      if (stage_to_rank[a.stage] != rank)
        fail("stage " + std::to_string(a.stage) + " lives on rank " + std::to_string(stage_to_rank[a.stage]));
      if (is_stage_wide(a.type) ? a.microbatch != -1 : (a.microbatch < 0 || a.microbatch >= microbatches))
        fail("microbatch out of range");
      if (is_send(a.type) || is_recv(a.type)) {
        const bool downstream = a.type == ActionType::SendF || a.type == ActionType::RecvB;
        const int peer_stage = downstream ? a.stage + 1 : a.stage - 1;
        if (peer_stage < 0 || peer_stage >= num_stages) fail("there is no neighbour stage to talk to");
        if (stage_to_rank[peer_stage] == rank)
          fail("the neighbour stage lives on the same rank; it hands tensors over without SEND/RECV");
      }
    }
  }

  // The compute actions alone follow the compute rules, with the given stage placement.
  ComputeGrid compute(pp);
  for (int rank = 0; rank < pp; ++rank)
    for (const Action& a : actions[rank])
      if (is_compute(a.type)) compute[rank].emplace_back(a);
  const std::vector<int> implied = validate_compute(compute, pp, num_stages, microbatches);
  TORCH_CHECK(implied == stage_to_rank, "validate_lowered: the compute actions place stages differently from ",
              "stage_to_rank\n\nFull pipeline schedule:\n", format_grid(grid));

  // SEND/RECV pairing and order, per ordered pair of ranks. A transfer is named by its SEND.
  std::map<std::pair<int, int>, std::vector<Action>> sent, received;  // (from, to) -> transfers in issue order
  std::unordered_map<ActionKey, std::pair<int, int>> send_position, recv_position;  // transfer -> (rank, step)
  for (int rank = 0; rank < pp; ++rank) {
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      if (!is_send(a.type) && !is_recv(a.type)) continue;
      const Action transfer = is_send(a.type) ? a : matching_send(a);
      const int from = stage_to_rank[transfer.stage];
      const int to = stage_to_rank[transfer.type == ActionType::SendF ? transfer.stage + 1 : transfer.stage - 1];
      auto& positions = is_send(a.type) ? send_position : recv_position;
      TORCH_CHECK(positions.emplace(key_of(transfer), std::make_pair(rank, step)).second,
                  error_with_grid("validate_lowered",
                                  "rank " + std::to_string(rank) + ", step " + std::to_string(step) + " (" +
                                      a.str() + "): the same transfer appears twice",
                                  grid, step));
      (is_send(a.type) ? sent : received)[{from, to}].push_back(transfer);
    }
  }
  for (const auto& [transfer, where] : send_position) {
    if (recv_position.count(transfer)) continue;
    const Action& send = actions[where.first][where.second];
    const Action recv{send.type == ActionType::SendF ? send.stage + 1 : send.stage - 1,
                      send.type == ActionType::SendF ? ActionType::RecvF : ActionType::RecvB, send.microbatch};
    TORCH_CHECK(false, error_with_grid("validate_lowered",
                                       "rank " + std::to_string(where.first) + ", step " +
                                           std::to_string(where.second) + " (" + send.str() + "): no matching " +
                                           recv.str() + " on rank " + std::to_string(stage_to_rank[recv.stage]),
                                       grid, where.second));
  }
  for (const auto& [transfer, where] : recv_position) {
    if (send_position.count(transfer)) continue;
    const Action& recv = actions[where.first][where.second];
    const Action send = matching_send(recv);
    TORCH_CHECK(false, error_with_grid("validate_lowered",
                                       "rank " + std::to_string(where.first) + ", step " +
                                           std::to_string(where.second) + " (" + recv.str() + "): no matching " +
                                           send.str() + " on rank " + std::to_string(stage_to_rank[send.stage]),
                                       grid, where.second));
  }
  for (const auto& [ranks, sends] : sent) {
    const auto& recvs = received[ranks];
    for (size_t i = 0; i < sends.size(); ++i) {
      if (sends[i] == recvs[i]) continue;
      const auto [rank, step] = recv_position.at(key_of(recvs[i]));
      TORCH_CHECK(false, error_with_grid("validate_lowered",
                                         "rank " + std::to_string(rank) + ", step " + std::to_string(step) +
                                             ": receives from rank " + std::to_string(ranks.first) + " in a different "
                                             "order than that rank sends (transfer #" + std::to_string(i) + " is " +
                                             sends[i].str() + " on the sender but " + recvs[i].str() +
                                             " here); P2P between two ranks matches in issue order",
                                         grid, step));
    }
  }

  // FSDP actions: compute only while unsharded; one REDUCE_GRAD per stage after its last B/W.
  for (int rank = 0; rank < pp; ++rank) {
    std::map<int, bool> unsharded, used;
    std::map<int, int> weight_grads_done, reduced;
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      auto fail = [&](const std::string& what) { fail_lowered_at(grid, rank, step, a, what); };
      switch (a.type) {
        case ActionType::Unshard:
          if (unsharded[a.stage]) fail("UNSHARD of a stage that is already unsharded");
          unsharded[a.stage] = true;
          used[a.stage] = false;
          break;
        case ActionType::Reshard:
          if (!unsharded[a.stage]) fail("RESHARD of a stage that is not unsharded");
          if (!used[a.stage]) fail("RESHARD of a stage that did not compute since its UNSHARD (unused unshard)");
          unsharded[a.stage] = false;
          break;
        case ActionType::ReduceGrad:
          if (reduced[a.stage]++) fail("a second REDUCE_GRAD for the stage");
          if (weight_grads_done[a.stage] != microbatches)
            fail("REDUCE_GRAD after " + std::to_string(weight_grads_done[a.stage]) + " of " +
                 std::to_string(microbatches) + " weight-gradient backwards (B or W)");
          if (!unsharded[a.stage]) fail("REDUCE_GRAD while the stage is resharded");
          break;
        default:
          if (!is_compute(a.type)) break;
          if (!unsharded[a.stage]) fail("computes on a sharded stage (no UNSHARD before it)");
          used[a.stage] = true;
          if (finishes_weight_grad(a.type)) {
            if (reduced[a.stage]) fail("a backward after the stage's REDUCE_GRAD");
            ++weight_grads_done[a.stage];
          }
      }
    }
    for (int stage = 0; stage < num_stages; ++stage) {
      if (stage_to_rank[stage] != rank) continue;
      TORCH_CHECK(!unsharded[stage], "validate_lowered: rank ", rank, ": stage ", stage,
                  " is still unsharded at the end (no RESHARD)\n\nFull pipeline schedule:\n", format_grid(grid));
      TORCH_CHECK(reduced[stage] == 1, "validate_lowered: rank ", rank, ": stage ", stage,
                  " has no REDUCE_GRAD\n\nFull pipeline schedule:\n", format_grid(grid));
    }
  }

  replay(actions, stage_to_rank, ReplayOptions{});
}

// ---------------------------------------------------------------------------------------------------------------
// Lowering

std::vector<Action> add_unshard_reshard(const std::vector<std::optional<Action>>& compute, int max_active_stages) {
  TORCH_CHECK(max_active_stages >= 1, "add_unshard_reshard: max_active_stages must be >= 1, got ",
              max_active_stages);
  // Last position of each stage: the look-ahead stops once it has seen every stage still to come, so a rank with
  // fewer stages than max_active_stages does not rescan its whole remaining list at every step.
  std::map<int, size_t> last_use;
  for (size_t i = 0; i < compute.size(); ++i)
    if (compute[i]) last_use[compute[i]->stage] = i;
  std::vector<Action> out;
  std::vector<int> active;  // unsharded stages, in the order they were unsharded
  for (size_t i = 0; i < compute.size(); ++i) {
    if (!compute[i]) continue;
    size_t stages_to_come = 0;
    for (const auto& [stage, last] : last_use) stages_to_come += last >= i ? 1 : 0;
    const size_t wanted = std::min(stages_to_come, static_cast<size_t>(max_active_stages));
    // The next max_active_stages distinct stages to compute, in order of first use: keep exactly these unsharded.
    std::vector<int> upcoming;
    for (size_t j = i; j < compute.size() && upcoming.size() < wanted; ++j)
      if (compute[j] && std::find(upcoming.begin(), upcoming.end(), compute[j]->stage) == upcoming.end())
        upcoming.push_back(compute[j]->stage);
    for (auto it = active.begin(); it != active.end();) {
      if (std::find(upcoming.begin(), upcoming.end(), *it) == upcoming.end()) {
        out.push_back(Action{*it, ActionType::Reshard, -1});
        it = active.erase(it);
      } else {
        ++it;
      }
    }
    for (int stage : upcoming) {
      if (std::find(active.begin(), active.end(), stage) != active.end()) continue;
      out.push_back(Action{stage, ActionType::Unshard, -1});
      active.push_back(stage);
    }
    out.push_back(*compute[i]);
  }
  for (int stage : active) out.push_back(Action{stage, ActionType::Reshard, -1});
  return out;
}

std::vector<Action> add_reduce_grad(const std::vector<Action>& actions, int microbatches) {
  std::vector<Action> out;
  std::map<int, int> weight_grads_done;
  for (const Action& a : actions) {
    out.push_back(a);
    if (finishes_weight_grad(a.type) && ++weight_grads_done[a.stage] == microbatches)
      out.push_back(Action{a.stage, ActionType::ReduceGrad, -1});
  }
  return out;
}

ActionLists add_send_recv(const ActionLists& actions, const std::vector<int>& stage_to_rank) {
  const int pp = static_cast<int>(actions.size());
  const int num_stages = static_cast<int>(stage_to_rank.size());
  auto rank_of = [&](int stage) {
    TORCH_CHECK(stage >= 0 && stage < num_stages, "add_send_recv: stage ", stage, " out of range [0, ", num_stages,
                ")");
    return stage_to_rank[stage];
  };
  // A compute action whose output goes to a stage on another rank, and the receiving stage.
  auto outgoing_peer_stage = [&](const Action& a) -> std::optional<int> {
    if (a.type == ActionType::Forward && a.stage != num_stages - 1 && rank_of(a.stage + 1) != rank_of(a.stage))
      return a.stage + 1;
    if (is_backward_like(a.type) && a.stage != 0 && rank_of(a.stage - 1) != rank_of(a.stage)) return a.stage - 1;
    return std::nullopt;
  };
  ActionLists out(pp);
  std::vector<std::unordered_set<ActionKey>> placed(pp);
  auto has = [&](int rank, int stage, ActionType type, int mb) {
    return placed[rank].count(key_of(stage, type, mb)) > 0;
  };
  // A rank never places its own RECVs: the sender appends them. So an action whose input comes from elsewhere
  // waits until its RECV (or, for a same-rank neighbour, the producing action) is already in the rank's list.
  auto ready = [&](int rank, const Action& a) {
    if (a.type == ActionType::Forward && a.stage != 0)
      return has(rank, a.stage, ActionType::RecvF, a.microbatch) ||
             has(rank, a.stage - 1, ActionType::Forward, a.microbatch);
    if (is_backward_like(a.type) && a.stage != num_stages - 1)
      return has(rank, a.stage, ActionType::RecvB, a.microbatch) ||
             has(rank, a.stage + 1, ActionType::BackwardInput, a.microbatch) ||
             has(rank, a.stage + 1, ActionType::Backward, a.microbatch);
    return true;
  };
  std::vector<size_t> next(pp, 0);
  while (true) {
    bool any_left = false, progress = false;
    for (int rank = 0; rank < pp; ++rank) {  // one action per rank per round, ranks in order
      if (next[rank] >= actions[rank].size()) continue;
      any_left = true;
      const Action& a = actions[rank][next[rank]];
      if (!ready(rank, a)) continue;
      out[rank].push_back(a);
      placed[rank].insert(key_of(a));
      if (auto peer = outgoing_peer_stage(a)) {
        const bool forward = a.type == ActionType::Forward;
        const Action send{a.stage, forward ? ActionType::SendF : ActionType::SendB, a.microbatch};
        const Action recv{*peer, forward ? ActionType::RecvF : ActionType::RecvB, a.microbatch};
        out[rank].push_back(send);
        placed[rank].insert(key_of(send));
        out[rank_of(*peer)].push_back(recv);
        placed[rank_of(*peer)].insert(key_of(recv));
      }
      ++next[rank];
      progress = true;
    }
    if (!any_left) break;
    if (!progress) {
      std::ostringstream stuck;
      for (int rank = 0; rank < pp; ++rank)
        if (next[rank] < actions[rank].size())
          stuck << "\n  rank " << rank << " cannot place " << actions[rank][next[rank]].str()
                << ": its input is never produced before it";
      TORCH_CHECK(false, "add_send_recv: malformed compute schedule, cannot place sends/receives:", stuck.str(),
                  "\n\nCompute schedule (with FSDP actions):\n", format_grid(as_grid(actions)));
    }
  }
  return out;
}

ActionLists lower_compute(const ComputeGrid& compute, const std::vector<int>& stage_to_rank, int microbatches) {
  ActionLists with_fsdp(compute.size());
  for (size_t rank = 0; rank < compute.size(); ++rank)
    with_fsdp[rank] = add_reduce_grad(add_unshard_reshard(compute[rank]), microbatches);
  return add_send_recv(with_fsdp, stage_to_rank);
}

// ---------------------------------------------------------------------------------------------------------------
// Building

PipelineSchedule build_schedule(const ScheduleSpec& spec) {
  check_spec(spec);
  PipelineSchedule schedule;
  schedule.spec = spec;
  const int pp = spec.pp, v = spec.stages_per_rank, m = spec.microbatches;
  schedule.num_stages = pp * v;
  schedule.stage_to_rank = spec.kind == ScheduleKind::ZBVZeroBubble ? v_stage_to_rank(pp, schedule.num_stages)
                                                                    : loop_stage_to_rank(pp, schedule.num_stages);
  ComputeGrid compute(pp);
  for (int rank = 0; rank < pp; ++rank) {
    switch (spec.kind) {
      case ScheduleKind::GPipe: compute[rank] = gpipe_rank(rank, m); break;
      case ScheduleKind::OneFOneB: compute[rank] = one_f_one_b_rank(rank, pp, m); break;
      case ScheduleKind::LoopedBFS: compute[rank] = looped_bfs_rank(rank, pp, v, m); break;
      case ScheduleKind::Interleaved1F1B: compute[rank] = interleaved_rank(rank, pp, v, m, false); break;
      case ScheduleKind::InterleavedZeroBubble: compute[rank] = interleaved_rank(rank, pp, v, m, true); break;
      case ScheduleKind::ZBVZeroBubble: compute[rank] = zbv_rank(rank, pp, m); break;
    }
  }
  if (spec.kind == ScheduleKind::InterleavedZeroBubble) compute = add_zero_bubble_idle_steps(compute);
  if (is_single_stage_kind(spec.kind)) compute = space_by_dependencies(compute, schedule.num_stages);

  const std::vector<int> implied = validate_compute(compute, pp, schedule.num_stages, m);
  TORCH_CHECK(implied == schedule.stage_to_rank, schedule_name(spec.kind),
              ": generated lists place stages differently from the expected stage->rank map (internal error)");
  schedule.compute = std::move(compute);

  if (is_single_stage_kind(spec.kind)) {
    schedule.actions.resize(pp);
    for (int rank = 0; rank < pp; ++rank)
      schedule.actions[rank] = lower_single_stage_rank(schedule.compute[rank], rank, schedule.num_stages);
  } else {
    schedule.actions = lower_compute(schedule.compute, schedule.stage_to_rank, m);
  }
  validate_lowered(schedule.actions, schedule.stage_to_rank, m);
  return schedule;
}

// ---------------------------------------------------------------------------------------------------------------
// Printing and simulation

std::string format_grid(const ComputeGrid& grid, int error_step) {
  size_t steps = 0;
  for (const auto& rank : grid) steps = std::max(steps, rank.size());
  const size_t label_digits = std::to_string(steps == 0 ? 0 : steps - 1).size();
  auto step_label = [&](size_t step) {
    std::string digits = std::to_string(step);
    return "Step " + std::string(label_digits - digits.size(), '0') + digits;
  };
  std::vector<size_t> width(grid.size());
  for (size_t r = 0; r < grid.size(); ++r) {
    width[r] = ("Rank " + std::to_string(r)).size();
    for (const auto& a : grid[r])
      if (a) width[r] = std::max(width[r], a->str().size());
  }
  auto pad = [](std::string text, size_t w) { return text + std::string(w > text.size() ? w - text.size() : 0, ' '); };
  std::ostringstream out;
  out << std::string(step_label(0).size() + 2, ' ');
  for (size_t r = 0; r < grid.size(); ++r) out << (r ? " " : "") << pad("Rank " + std::to_string(r), width[r]);
  out << "\n";
  for (size_t step = 0; step < steps; ++step) {
    out << step_label(step) << ": ";
    for (size_t r = 0; r < grid.size(); ++r) {
      const bool has = step < grid[r].size() && grid[r][step];
      out << (r ? " " : "") << pad(has ? grid[r][step]->str() : "", width[r]);
    }
    if (static_cast<int>(step) == error_step) out << " <-- ERROR HERE";
    out << "\n";
  }
  return out.str();
}

std::string format_schedule(const PipelineSchedule& schedule, bool with_comms) {
  std::ostringstream out;
  out << schedule_name(schedule.spec.kind) << " pp=" << schedule.spec.pp
      << " stages_per_rank=" << schedule.spec.stages_per_rank << " microbatches=" << schedule.spec.microbatches
      << (with_comms ? " (lowered)" : " (compute)") << "\n";
  out << format_grid(with_comms ? as_grid(schedule.actions) : schedule.compute);
  return out.str();
}

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
  ReplayOptions options;
  options.costs = &costs;
  options.recv_blocks_rank = costs.recv_waits_in_place;
  const ReplayTimes times = replay(schedule.actions, schedule.stage_to_rank, options);
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
