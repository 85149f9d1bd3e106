// Lowering: torch's _prepare_schedule_with_comms passes, which turn compute-only lists into the lists the runtime
// executes (UNSHARD / RESHARD for FSDP, REDUCE_GRAD once per stage, SEND / RECV between ranks), and the GPipe /
// 1F1B lowering that follows their runtime loops.
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_set>

namespace fsdp::pipeline {
using detail::ActionKey;
using detail::as_grid;
using detail::finishes_weight_grad;
using detail::is_backward_like;
using detail::key_of;

namespace detail {

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

}  // namespace detail

std::vector<Action> add_unshard_reshard(const std::vector<std::optional<Action>>& compute, int max_active_stages) {
  TORCH_CHECK(max_active_stages >= 1, "add_unshard_reshard: max_active_stages must be >= 1, got ",
              max_active_stages);
  // Last position of each stage: the look-ahead stops once it has seen every stage still to come, so a rank with
  // fewer stages than max_active_stages does not rescan its whole remaining list at every step.
  std::map<int, size_t> last_use;
  for (size_t i = 0; i < compute.size(); ++i)
    if (compute[i])
      for (const Action& leaf : compute[i]->leaves()) last_use[leaf.stage] = i;
  std::vector<Action> out;
  std::vector<int> active;  // unsharded stages, in the order they were unsharded
  for (size_t i = 0; i < compute.size(); ++i) {
    if (!compute[i]) continue;
    size_t stages_to_come = 0;
    for (const auto& [stage, last] : last_use) stages_to_come += last >= i ? 1 : 0;
    const size_t wanted = std::min(stages_to_come, static_cast<size_t>(max_active_stages));
    // The next max_active_stages distinct stages to compute, in order of first use: keep exactly these unsharded.
    // (An OVERLAP_F_B brings both its stages, as torch's next_stage_indices does.)
    std::vector<int> upcoming;
    for (size_t j = i; j < compute.size() && upcoming.size() < wanted; ++j) {
      if (!compute[j]) continue;
      for (const Action& leaf : compute[j]->leaves())
        if (std::find(upcoming.begin(), upcoming.end(), leaf.stage) == upcoming.end()) upcoming.push_back(leaf.stage);
    }
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
    for (const Action& leaf : a.leaves())  // an OVERLAP_F_B's reductions follow the pair
      if (finishes_weight_grad(leaf.type) && ++weight_grads_done[leaf.stage] == microbatches)
        out.push_back(Action{leaf.stage, ActionType::ReduceGrad, -1});
  }
  return out;
}

namespace detail {

std::vector<std::pair<int, size_t>> place_send_recv(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                                                    ActionLists* out) {
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
  ActionLists placed_lists(pp);
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
      // An OVERLAP_F_B waits until both its parts are ready; then each part's SEND follows the pair (torch).
      const std::vector<Action> leaves = a.leaves();
      if (!std::all_of(leaves.begin(), leaves.end(), [&](const Action& leaf) { return ready(rank, leaf); }))
        continue;
      placed_lists[rank].push_back(a);
      for (const Action& leaf : leaves) {
        placed[rank].insert(key_of(leaf));
        if (auto peer = outgoing_peer_stage(leaf)) {
          const bool forward = leaf.type == ActionType::Forward;
          const Action send{leaf.stage, forward ? ActionType::SendF : ActionType::SendB, leaf.microbatch};
          const Action recv{*peer, forward ? ActionType::RecvF : ActionType::RecvB, leaf.microbatch};
          placed_lists[rank].push_back(send);
          placed[rank].insert(key_of(send));
          placed_lists[rank_of(*peer)].push_back(recv);
          placed[rank_of(*peer)].insert(key_of(recv));
        }
      }
      ++next[rank];
      progress = true;
    }
    if (!any_left) break;
    if (!progress) {
      std::vector<std::pair<int, size_t>> stuck;
      for (int rank = 0; rank < pp; ++rank)
        if (next[rank] < actions[rank].size()) stuck.emplace_back(rank, next[rank]);
      return stuck;
    }
  }
  if (out) *out = std::move(placed_lists);
  return {};
}

}  // namespace detail

ActionLists add_send_recv(const ActionLists& actions, const std::vector<int>& stage_to_rank) {
  ActionLists out;
  const auto stuck = detail::place_send_recv(actions, stage_to_rank, &out);
  if (!stuck.empty()) {
    std::ostringstream message;
    for (const auto& [rank, index] : stuck)
      message << "\n  rank " << rank << " cannot place " << actions[rank][index].str()
              << ": its input is never produced before it";
    TORCH_CHECK(false, "add_send_recv: malformed compute schedule, cannot place sends/receives:", message.str(),
                "\n\nCompute schedule (with FSDP actions):\n", format_grid(as_grid(actions)));
  }
  return out;
}

ActionLists lower_compute(const ComputeGrid& compute, const std::vector<int>& stage_to_rank, int microbatches) {
  ActionLists with_fsdp(compute.size());
  for (size_t rank = 0; rank < compute.size(); ++rank)
    with_fsdp[rank] = add_reduce_grad(add_unshard_reshard(compute[rank]), microbatches);
  return add_send_recv(with_fsdp, stage_to_rank);
}

}  // namespace fsdp::pipeline
