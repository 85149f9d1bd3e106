// Validation of schedules, one function per rule. validate_compute checks compute-only lists (torch's
// _validate_schedule, stricter where torch uses sets); validate_lowered checks the lists the runtime executes
// (ownership, P2P pairing and order, FSDP actions, and a dry run that finds deadlocks). Every error names the
// rank, the step and the action, and prints the whole grid with "<-- ERROR HERE" on the offending step.
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <map>
#include <optional>
#include <unordered_map>

namespace fsdp::pipeline {
using detail::ActionKey;
using detail::as_grid;
using detail::error_with_grid;
using detail::finishes_weight_grad;
using detail::is_stage_wide;
using detail::key_of;
using detail::matching_send;
namespace {

// A rule's verdict on one action: nullopt when it holds, else what is wrong.
using Violation = std::optional<std::string>;

[[noreturn]] void fail_at(const char* where, const ComputeGrid& grid, int rank, int step, const Action& a,
                          const std::string& what) {
  TORCH_CHECK(false, error_with_grid(where,
                                     "rank " + std::to_string(rank) + ", step " + std::to_string(step) + " (" +
                                         a.str() + "): " + what,
                                     grid, step));
}

// ---------------------------------------------------------------------------------------------------------------
// Compute-only lists. The walk visits the actions rank by rank and asks each rule in turn.

struct ComputeWalk {
  int num_stages = 0;
  int microbatches = 0;
  std::vector<int> stage_to_rank;  // -1 until a stage is seen
  // Per stage and microbatch: which of F, B, I, W have run.
  enum Seen : unsigned { kF = 1, kB = 2, kI = 4, kW = 8 };
  std::vector<std::vector<unsigned>> seen;
};

// Only F, B, I, W and OVERLAP_F_B belong in a compute list.
Violation rule_compute_only(const Action& a) {
  if (!is_compute(a.type)) return "not a compute action (F, B, I, W or OVERLAP_F_B)";
  return std::nullopt;
}

// An OVERLAP_F_B holds F, B, I or W actions (at least one, none nested), each of its own stage.
Violation rule_overlap_parts(const Action& a) {
  if (a.type != ActionType::OverlapFB) return std::nullopt;
  if (a.sub_actions.empty()) return "an OVERLAP_F_B without sub-actions";
  for (const Action& part : a.sub_actions)
    if (!is_compute(part.type) || part.type == ActionType::OverlapFB)
      return "an OVERLAP_F_B part must be one F, B, I or W action, got " + part.str();
  return std::nullopt;
}

Violation rule_stage_in_range(const ComputeWalk& w, const Action& a) {
  if (a.stage < 0 || a.stage >= w.num_stages) return "stage out of range [0, " + std::to_string(w.num_stages) + ")";
  return std::nullopt;
}

Violation rule_microbatch_in_range(const ComputeWalk& w, const Action& a) {
  if (a.microbatch < 0 || a.microbatch >= w.microbatches)
    return "microbatch out of range [0, " + std::to_string(w.microbatches) + ")";
  return std::nullopt;
}

// Every stage lives on exactly one rank (records the placement).
Violation rule_one_rank_per_stage(ComputeWalk& w, int rank, const Action& a) {
  int& placed = w.stage_to_rank[a.stage];
  if (placed == -1) placed = rank;
  if (placed != rank)
    return "stage " + std::to_string(a.stage) + " is assigned to both rank " + std::to_string(rank) + " and rank " +
           std::to_string(placed);
  return std::nullopt;
}

// B and I after the F of the same stage and microbatch, W after its I, each at most once (records what ran).
Violation rule_compute_order(ComputeWalk& w, const Action& a) {
  unsigned& s = w.seen[a.stage][a.microbatch];
  switch (a.type) {
    case ActionType::Forward:
      if (s & ComputeWalk::kF) return "a second Forward of the same stage and microbatch";
      s |= ComputeWalk::kF;
      break;
    case ActionType::Backward:
      if (!(s & ComputeWalk::kF)) return "Full Backward without first running Forward";
      if (s & (ComputeWalk::kB | ComputeWalk::kI)) return "a second backward of the same stage and microbatch";
      s |= ComputeWalk::kB;
      break;
    case ActionType::BackwardInput:
      if (!(s & ComputeWalk::kF)) return "Backward Input without first running Forward";
      if (s & (ComputeWalk::kB | ComputeWalk::kI)) return "a second backward of the same stage and microbatch";
      s |= ComputeWalk::kI;
      break;
    case ActionType::BackwardWeight:
      if (!(s & ComputeWalk::kI)) return "Backward Weight without first running Backward Input";
      if (s & ComputeWalk::kW) return "a second Backward Weight of the same stage and microbatch";
      s |= ComputeWalk::kW;
      break;
    default:
      break;
  }
  return std::nullopt;
}

// After the walk: every stage appears on some rank.
std::optional<detail::ComputeViolation> rule_every_stage_placed(const ComputeWalk& w) {
  for (int stage = 0; stage < w.num_stages; ++stage)
    if (w.stage_to_rank[stage] == -1)
      return detail::ComputeViolation{-1, -1, {}, "stage " + std::to_string(stage) + " appears on no rank"};
  return std::nullopt;
}

// After the walk: each (stage, microbatch) has one F and either one B or one I and one W.
std::optional<detail::ComputeViolation> rule_every_microbatch_complete(const ComputeWalk& w) {
  for (int stage = 0; stage < w.num_stages; ++stage) {
    for (int mb = 0; mb < w.microbatches; ++mb) {
      const unsigned s = w.seen[stage][mb];
      std::string missing;
      if (!(s & ComputeWalk::kF)) missing = "no Forward";
      else if (!(s & (ComputeWalk::kB | ComputeWalk::kI))) missing = "no backward (B, or I and W)";
      else if ((s & ComputeWalk::kI) && !(s & ComputeWalk::kW)) missing = "a Backward Input but no Backward Weight";
      if (!missing.empty())
        return detail::ComputeViolation{w.stage_to_rank[stage], -1, {},
                                        "stage " + std::to_string(stage) + " (rank " +
                                            std::to_string(w.stage_to_rank[stage]) + "), microbatch " +
                                            std::to_string(mb) + " has " + missing};
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------------------------
// Lowered lists.

// Per action: stage and microbatch in range, the stage lives on this rank.
void rule_actions_owned(const ActionLists& actions, const std::vector<int>& stage_to_rank, int microbatches,
                        const ComputeGrid& grid) {
  const int num_stages = static_cast<int>(stage_to_rank.size());
  for (int rank = 0; rank < static_cast<int>(actions.size()); ++rank) {
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      for (const Action& a : actions[rank][step].leaves()) {
        auto fail = [&](const std::string& what) { fail_at("validate_lowered", grid, rank, step, a, what); };
        if (a.stage < 0 || a.stage >= num_stages) fail("stage out of range");
        if (stage_to_rank[a.stage] != rank)
          fail("stage " + std::to_string(a.stage) + " lives on rank " + std::to_string(stage_to_rank[a.stage]));
        if (is_stage_wide(a.type) ? a.microbatch != -1 : (a.microbatch < 0 || a.microbatch >= microbatches))
          fail("microbatch out of range");
      }
    }
  }
}

// SEND / RECV only towards an existing neighbour stage on another rank (same-rank stages hand tensors over in
// memory).
void rule_p2p_between_ranks(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                            const ComputeGrid& grid) {
  const int num_stages = static_cast<int>(stage_to_rank.size());
  for (int rank = 0; rank < static_cast<int>(actions.size()); ++rank) {
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      if (!is_send(a.type) && !is_recv(a.type)) continue;
      auto fail = [&](const std::string& what) { fail_at("validate_lowered", grid, rank, step, a, what); };
      const bool downstream = a.type == ActionType::SendF || a.type == ActionType::RecvB;
      const int peer_stage = downstream ? a.stage + 1 : a.stage - 1;
      if (peer_stage < 0 || peer_stage >= num_stages) fail("there is no neighbour stage to talk to");
      if (stage_to_rank[peer_stage] == rank)
        fail("the neighbour stage lives on the same rank; it hands tensors over without SEND/RECV");
    }
  }
}

// The compute actions alone follow validate_compute's rules and place stages as stage_to_rank says.
void rule_compute_actions_valid(const ActionLists& actions, const std::vector<int>& stage_to_rank, int microbatches,
                                const ComputeGrid& grid) {
  const int pp = static_cast<int>(actions.size());
  ComputeGrid compute(pp);
  for (int rank = 0; rank < pp; ++rank)
    for (const Action& a : actions[rank])
      if (is_compute(a.type)) compute[rank].emplace_back(a);
  const std::vector<int> implied =
      validate_compute(compute, pp, static_cast<int>(stage_to_rank.size()), microbatches);
  TORCH_CHECK(implied == stage_to_rank, "validate_lowered: the compute actions place stages differently from ",
              "stage_to_rank\n\nFull pipeline schedule:\n", format_grid(grid));
}

// Where each transfer (named by its SEND) is sent and received, and per ordered pair of ranks the issue order.
struct Transfers {
  std::map<std::pair<int, int>, std::vector<Action>> sent, received;  // (from, to) -> transfers in issue order
  std::unordered_map<ActionKey, std::pair<int, int>> send_position, recv_position;  // transfer -> (rank, step)
};

// Each transfer is sent once and received once.
Transfers rule_transfers_unique(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                                const ComputeGrid& grid) {
  Transfers t;
  for (int rank = 0; rank < static_cast<int>(actions.size()); ++rank) {
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      if (!is_send(a.type) && !is_recv(a.type)) continue;
      const Action transfer = is_send(a.type) ? a : matching_send(a);
      const int from = stage_to_rank[transfer.stage];
      const int to = stage_to_rank[transfer.type == ActionType::SendF ? transfer.stage + 1 : transfer.stage - 1];
      auto& positions = is_send(a.type) ? t.send_position : t.recv_position;
      if (!positions.emplace(key_of(transfer), std::make_pair(rank, step)).second)
        fail_at("validate_lowered", grid, rank, step, a, "the same transfer appears twice");
      (is_send(a.type) ? t.sent : t.received)[{from, to}].push_back(transfer);
    }
  }
  return t;
}

// Every SEND has its RECV on the neighbour stage's rank.
void rule_every_send_received(const Transfers& t, const ActionLists& actions, const std::vector<int>& stage_to_rank,
                              const ComputeGrid& grid) {
  for (const auto& [transfer, where] : t.send_position) {
    if (t.recv_position.count(transfer)) continue;
    const Action& send = actions[where.first][where.second];
    const Action recv{send.type == ActionType::SendF ? send.stage + 1 : send.stage - 1,
                      send.type == ActionType::SendF ? ActionType::RecvF : ActionType::RecvB, send.microbatch};
    fail_at("validate_lowered", grid, where.first, where.second, send,
            "no matching " + recv.str() + " on rank " + std::to_string(stage_to_rank[recv.stage]));
  }
}

// Every RECV has its SEND on the neighbour stage's rank.
void rule_every_recv_sent(const Transfers& t, const ActionLists& actions, const std::vector<int>& stage_to_rank,
                          const ComputeGrid& grid) {
  for (const auto& [transfer, where] : t.recv_position) {
    if (t.send_position.count(transfer)) continue;
    const Action& recv = actions[where.first][where.second];
    const Action send = matching_send(recv);
    fail_at("validate_lowered", grid, where.first, where.second, recv,
            "no matching " + send.str() + " on rank " + std::to_string(stage_to_rank[send.stage]));
  }
}

// Between each pair of ranks the receives are posted in the order of the sends (P2P matches in issue order).
void rule_p2p_in_send_order(const Transfers& t, const ComputeGrid& grid) {
  for (const auto& [ranks, sends] : t.sent) {
    const auto& recvs = t.received.at(ranks);
    for (size_t i = 0; i < sends.size(); ++i) {
      if (sends[i] == recvs[i]) continue;
      const auto [rank, step] = t.recv_position.at(key_of(recvs[i]));
      TORCH_CHECK(false, error_with_grid("validate_lowered",
                                         "rank " + std::to_string(rank) + ", step " + std::to_string(step) +
                                             ": receives from rank " + std::to_string(ranks.first) +
                                             " in a different order than that rank sends (transfer #" +
                                             std::to_string(i) + " is " + sends[i].str() + " on the sender but " +
                                             recvs[i].str() + " here); P2P between two ranks matches in issue order",
                                         grid, step));
    }
  }
}

// A stage computes only between its UNSHARD and its RESHARD; no double UNSHARD, no RESHARD without one or without
// a compute since, nothing left unsharded at the end.
void rule_compute_while_unsharded(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                                  const ComputeGrid& grid) {
  for (int rank = 0; rank < static_cast<int>(actions.size()); ++rank) {
    std::map<int, bool> unsharded, used;
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      auto fail = [&](const std::string& what) { fail_at("validate_lowered", grid, rank, step, a, what); };
      if (a.type == ActionType::Unshard) {
        if (unsharded[a.stage]) fail("UNSHARD of a stage that is already unsharded");
        unsharded[a.stage] = true;
        used[a.stage] = false;
      } else if (a.type == ActionType::Reshard) {
        if (!unsharded[a.stage]) fail("RESHARD of a stage that is not unsharded");
        if (!used[a.stage]) fail("RESHARD of a stage that did not compute since its UNSHARD (unused unshard)");
        unsharded[a.stage] = false;
      } else if (is_compute(a.type)) {
        for (const Action& leaf : a.leaves()) {
          if (!unsharded[leaf.stage]) fail("computes on a sharded stage (no UNSHARD before it)");
          used[leaf.stage] = true;
        }
      }
    }
    for (int stage = 0; stage < static_cast<int>(stage_to_rank.size()); ++stage)
      TORCH_CHECK(stage_to_rank[stage] != rank || !unsharded[stage], "validate_lowered: rank ", rank, ": stage ",
                  stage, " is still unsharded at the end (no RESHARD)\n\nFull pipeline schedule:\n",
                  format_grid(grid));
  }
}

// REDUCE_GRAD once per stage, after its m-th B/W, while unsharded, and no B/W after it.
void rule_reduce_grad_once_after_last_backward(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                                               int microbatches, const ComputeGrid& grid) {
  for (int rank = 0; rank < static_cast<int>(actions.size()); ++rank) {
    std::map<int, bool> unsharded;
    std::map<int, int> weight_grads_done, reduced;
    for (int step = 0; step < static_cast<int>(actions[rank].size()); ++step) {
      const Action& a = actions[rank][step];
      auto fail = [&](const std::string& what) { fail_at("validate_lowered", grid, rank, step, a, what); };
      if (a.type == ActionType::Unshard || a.type == ActionType::Reshard) {
        unsharded[a.stage] = a.type == ActionType::Unshard;
      } else if (a.type == ActionType::ReduceGrad) {
        if (reduced[a.stage]++) fail("a second REDUCE_GRAD for the stage");
        if (weight_grads_done[a.stage] != microbatches)
          fail("REDUCE_GRAD after " + std::to_string(weight_grads_done[a.stage]) + " of " +
               std::to_string(microbatches) + " weight-gradient backwards (B or W)");
        if (!unsharded[a.stage]) fail("REDUCE_GRAD while the stage is resharded");
      } else {
        for (const Action& leaf : a.leaves()) {
          if (!finishes_weight_grad(leaf.type)) continue;
          if (reduced[leaf.stage]) fail("a backward after the stage's REDUCE_GRAD");
          ++weight_grads_done[leaf.stage];
        }
      }
    }
    for (int stage = 0; stage < static_cast<int>(stage_to_rank.size()); ++stage)
      TORCH_CHECK(stage_to_rank[stage] != rank || reduced[stage] == 1, "validate_lowered: rank ", rank, ": stage ",
                  stage, " has no REDUCE_GRAD\n\nFull pipeline schedule:\n", format_grid(grid));
  }
}

// A dry run finishes: every compute has its input when it runs, every RECV's SEND is issued (else the error names
// every rank's blocked action).
void rule_no_deadlock(const ActionLists& actions, const std::vector<int>& stage_to_rank) {
  detail::replay(actions, stage_to_rank, detail::ReplayOptions{});
}

}  // namespace

namespace detail {

std::optional<ComputeViolation> check_compute(const ComputeGrid& compute, int num_stages, int microbatches,
                                              std::vector<int>* stage_to_rank) {
  ComputeWalk walk;
  walk.num_stages = num_stages;
  walk.microbatches = microbatches;
  walk.stage_to_rank.assign(num_stages, -1);
  walk.seen.assign(num_stages, std::vector<unsigned>(microbatches, 0));
  for (int rank = 0; rank < static_cast<int>(compute.size()); ++rank) {
    for (int step = 0; step < static_cast<int>(compute[rank].size()); ++step) {
      if (!compute[rank][step]) continue;
      const Action& a = *compute[rank][step];
      // In this order: the later rules index by stage and microbatch, so each runs only once the earlier hold.
      for (const Violation& v : {rule_compute_only(a), rule_overlap_parts(a)})
        if (v) return ComputeViolation{rank, step, a, *v};
      for (const Action& leaf : a.leaves()) {  // an OVERLAP_F_B's parts in the order they run (the part is named)
        if (Violation v = rule_stage_in_range(walk, leaf)) return ComputeViolation{rank, step, leaf, *v};
        if (Violation v = rule_microbatch_in_range(walk, leaf)) return ComputeViolation{rank, step, leaf, *v};
        if (Violation v = rule_one_rank_per_stage(walk, rank, leaf)) return ComputeViolation{rank, step, leaf, *v};
        if (Violation v = rule_compute_order(walk, leaf)) return ComputeViolation{rank, step, leaf, *v};
      }
    }
  }
  if (auto v = rule_every_stage_placed(walk)) return v;
  if (auto v = rule_every_microbatch_complete(walk)) return v;
  if (stage_to_rank) *stage_to_rank = std::move(walk.stage_to_rank);
  return std::nullopt;
}

}  // namespace detail

std::vector<int> validate_compute(const ComputeGrid& compute, int pp, int num_stages, int microbatches) {
  TORCH_CHECK(static_cast<int>(compute.size()) == pp, "validate_compute: the schedule has ", compute.size(),
              " rank lists, expected pp=", pp);
  TORCH_CHECK(num_stages >= 1 && microbatches >= 1, "validate_compute: num_stages and microbatches must be >= 1");
  std::vector<int> stage_to_rank;
  if (auto v = detail::check_compute(compute, num_stages, microbatches, &stage_to_rank)) {
    if (v->step >= 0) fail_at("validate_compute", compute, v->rank, v->step, v->action, v->what);
    TORCH_CHECK(false, error_with_grid("validate_compute", v->what, compute, -1));
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
  rule_actions_owned(actions, stage_to_rank, microbatches, grid);
  rule_p2p_between_ranks(actions, stage_to_rank, grid);
  rule_compute_actions_valid(actions, stage_to_rank, microbatches, grid);
  const Transfers transfers = rule_transfers_unique(actions, stage_to_rank, grid);
  rule_every_send_received(transfers, actions, stage_to_rank, grid);
  rule_every_recv_sent(transfers, actions, stage_to_rank, grid);
  rule_p2p_in_send_order(transfers, grid);
  rule_compute_while_unsharded(actions, stage_to_rank, grid);
  rule_reduce_grad_once_after_last_backward(actions, stage_to_rank, microbatches, grid);
  rule_no_deadlock(actions, stage_to_rank);
}

}  // namespace fsdp::pipeline
