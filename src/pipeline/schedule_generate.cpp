// Schedule generators: the compute-only list of every rank, exactly as torch 2.13's schedule classes build
// pipeline_order (GPipe / 1F1B: the order their runtime loops execute), the stage -> rank maps, the checks of a
// spec, and build_schedule, which chains generation, validation and lowering.
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <unordered_set>

namespace fsdp::pipeline {
using detail::ActionKey;
using detail::key_of;
namespace {

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

// ScheduleDualPipeV._calculate_single_rank_operations (DeepSeek's DualPipe folded into a V): chunk 0 is stage
// `rank`, chunk 1 stage 2p-1-rank. Warm-up forwards, zero-bubble I/W on chunk 1, then the main phase of
// overlapped pairs (F of one chunk with the full backward of the other), the drain, and the deferred Ws. The
// microbatch of each action comes from per-(stage, type) counters; a full backward advances both the I and the W
// counter, and a W runs the oldest pending I's weight part (torch's weight queue).
RankList dualpipev_rank(int rank, int pp, int microbatches) {
  const int chunk0 = rank;
  const int chunk1 = 2 * pp - 1 - rank;
  std::map<std::pair<int, ActionType>, int> counters;
  std::vector<std::pair<int, int>> weight_queue;  // (stage, microbatch) of I's whose W is pending, oldest first
  size_t weights_done = 0;
  RankList ops;
  auto take = [&](int stage, ActionType type) { return counters[{stage, type}]++; };
  auto full_backward = [&](int stage) {  // B: microbatch from the I counter, then both counters move
    const int mb = take(stage, ActionType::BackwardInput);
    ++counters[{stage, ActionType::BackwardWeight}];
    return Action{stage, ActionType::Backward, mb};
  };
  auto add = [&](int stage, ActionType type) {
    if (type == ActionType::Backward) {
      ops.push_back(full_backward(stage));
      return;
    }
    const int mb = take(stage, type);
    if (type == ActionType::BackwardInput) weight_queue.emplace_back(stage, mb);
    ops.push_back(Action{stage, type, mb});
  };
  auto add_overlap = [&](int forward_stage, int backward_stage) {
    Action forward{forward_stage, ActionType::Forward, take(forward_stage, ActionType::Forward)};
    ops.push_back(Action::overlap(std::move(forward), full_backward(backward_stage)));
  };
  auto add_pending_weight = [&]() {
    if (weights_done == weight_queue.size()) return;
    const auto [stage, mb] = weight_queue[weights_done++];
    ++counters[{stage, ActionType::BackwardWeight}];
    ops.push_back(Action{stage, ActionType::BackwardWeight, mb});
  };

  for (int i = 0; i < 2 * (pp - rank - 1); ++i) add(chunk0, ActionType::Forward);  // 1: F0
  for (int i = 0; i < rank + 1; ++i) {                                               // 2: F0 F1
    add(chunk0, ActionType::Forward);
    add(chunk1, ActionType::Forward);
  }
  for (int i = 0; i < pp - rank - 1; ++i) {  // 3: I1 W1 F1 (zero bubble)
    add(chunk1, ActionType::BackwardInput);
    add_pending_weight();
    add(chunk1, ActionType::Forward);
  }
  const int main_steps = microbatches - 2 * pp + rank + 1;
  for (int i = 0; i < main_steps; ++i) {  // 4: (F0 B1) (F1 B0), overlapped
    if (i == 0 && rank == pp - 1) {       // torch: not overlapped here, to shrink the bubble further
      add(chunk0, ActionType::Forward);
      add(chunk1, ActionType::Backward);
    } else {
      add_overlap(chunk0, chunk1);
    }
    add_overlap(chunk1, chunk0);
  }
  for (int i = 0; i < pp - rank - 1; ++i) {  // 5: B1 (F1 B0)
    add(chunk1, ActionType::Backward);
    add_overlap(chunk1, chunk0);
  }
  const int drain = rank + 1;  // 6: B1 B0, the second half zero-bubble (I now, W later)
  bool zero_bubble = false;
  for (int i = 0; i < drain; ++i) {
    if (i == drain / 2 && rank % 2 == 1) zero_bubble = true;
    add(chunk1, zero_bubble ? ActionType::BackwardInput : ActionType::Backward);
    if (i == drain / 2 && rank % 2 == 0) zero_bubble = true;
    add(chunk0, zero_bubble ? ActionType::BackwardInput : ActionType::Backward);
  }
  for (int i = 0; i < pp - rank - 1; ++i) {  // 7: W0 B0
    add_pending_weight();
    add(chunk0, zero_bubble ? ActionType::BackwardInput : ActionType::Backward);
  }
  for (int i = 0; i < rank + 1; ++i) add_pending_weight();  // 8: W0
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
    case ScheduleKind::DualPipeV:
      TORCH_CHECK(spec.stages_per_rank == 2, "DualPipeV requires exactly 2 stages per rank (the V), got ",
                  spec.stages_per_rank);
      TORCH_CHECK(spec.microbatches >= 2 * spec.pp,
                  "DualPipeV requires at least as many microbatches as stages, but got ", spec.microbatches,
                  " microbatches and ", 2 * spec.pp, " stages");
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
    case ScheduleKind::Csv:
      TORCH_CHECK(false, "a CSV schedule is read with load_schedule_csv, not built from a spec");
  }
}

}  // namespace

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
// Building

PipelineSchedule build_schedule(const ScheduleSpec& spec) {
  check_spec(spec);
  PipelineSchedule schedule;
  schedule.spec = spec;
  const int pp = spec.pp, v = spec.stages_per_rank, m = spec.microbatches;
  schedule.num_stages = pp * v;
  const bool v_shape = spec.kind == ScheduleKind::ZBVZeroBubble || spec.kind == ScheduleKind::DualPipeV;
  schedule.stage_to_rank =
      v_shape ? v_stage_to_rank(pp, schedule.num_stages) : loop_stage_to_rank(pp, schedule.num_stages);
  ComputeGrid compute(pp);
  for (int rank = 0; rank < pp; ++rank) {
    switch (spec.kind) {
      case ScheduleKind::GPipe: compute[rank] = gpipe_rank(rank, m); break;
      case ScheduleKind::OneFOneB: compute[rank] = one_f_one_b_rank(rank, pp, m); break;
      case ScheduleKind::LoopedBFS: compute[rank] = looped_bfs_rank(rank, pp, v, m); break;
      case ScheduleKind::Interleaved1F1B: compute[rank] = interleaved_rank(rank, pp, v, m, false); break;
      case ScheduleKind::InterleavedZeroBubble: compute[rank] = interleaved_rank(rank, pp, v, m, true); break;
      case ScheduleKind::ZBVZeroBubble: compute[rank] = zbv_rank(rank, pp, m); break;
      case ScheduleKind::DualPipeV: compute[rank] = dualpipev_rank(rank, pp, m); break;
      case ScheduleKind::Csv: break;  // refused by check_spec
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
      schedule.actions[rank] = detail::lower_single_stage_rank(schedule.compute[rank], rank, schedule.num_stages);
  } else {
    schedule.actions = lower_compute(schedule.compute, schedule.stage_to_rank, m);
  }
  validate_lowered(schedule.actions, schedule.stage_to_rank, m);
  return schedule;
}

}  // namespace fsdp::pipeline
