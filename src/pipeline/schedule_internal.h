#pragma once
// What the schedule passes share (src/pipeline/schedule_*.cpp; not a public header): action classification,
// hashable action identities, the grid used by every error message, and the replay that both the validator's dry
// run and the simulator use. The files, one job each:
//   schedule_text.cpp      action strings, schedule names, the printable grid
//   schedule_generate.cpp  the schedules' compute lists (torch's generators) and build_schedule
//   schedule_lower.cpp     the lowering passes (UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV)
//   schedule_validate.cpp  validate_compute / validate_lowered, one function per rule
//   schedule_simulate.cpp  the replay of lowered lists and the simulator

#include <fsdp/pipeline/schedule.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::pipeline::detail {

// UNSHARD / RESHARD / REDUCE_GRAD act on the whole stage (no microbatch).
inline bool is_stage_wide(ActionType type) {
  return type == ActionType::Unshard || type == ActionType::Reshard || type == ActionType::ReduceGrad;
}

// Produces the gradient sent upstream.
inline bool is_backward_like(ActionType type) {
  return type == ActionType::Backward || type == ActionType::BackwardInput;
}

// What REDUCE_GRAD waits for (torch: B or W).
inline bool finishes_weight_grad(ActionType type) {
  return type == ActionType::Backward || type == ActionType::BackwardWeight;
}

// A hashable identity for an action (sets of "already happened" actions). Unsigned arithmetic: a nonsense stage
// number in a hand-made list must not overflow before validation reports it.
using ActionKey = uint64_t;
inline ActionKey key_of(int stage, ActionType type, int microbatch) {
  return (static_cast<ActionKey>(static_cast<uint32_t>(stage)) * 16 + static_cast<ActionKey>(type)) << 32 |
         static_cast<uint32_t>(microbatch + 1);
}
inline ActionKey key_of(const Action& a) { return key_of(a.stage, a.type, a.microbatch); }

// The lowered lists as a grid (for format_grid in error messages).
ComputeGrid as_grid(const ActionLists& lists);

// "<where>: <what>" followed by the whole grid, `step` marked (step < 0: no mark).
std::string error_with_grid(const std::string& where, const std::string& what, const ComputeGrid& grid, int step);

// The send an incoming transfer matches: (sender stage, SEND type, microbatch).
Action matching_send(const Action& recv);

// GPipe / 1F1B lowering of one rank (their runtime loops' order); build_schedule uses it for the single-stage kinds.
std::vector<Action> lower_single_stage_rank(const std::vector<std::optional<Action>>& compute, int stage,
                                            int num_stages);

// The first rule of validate_compute that a compute grid breaks: where (rank and step, -1 when the rule is about
// the whole list, e.g. a microbatch without its backward), the action (a part, for an OVERLAP_F_B) and what. The
// CSV loader turns it into "file, row, column"; validate_compute into the grid with the step marked.
struct ComputeViolation {
  int rank = -1;
  int step = -1;
  Action action;
  std::string what;
};
// nullopt when the grid is valid; then *stage_to_rank (when given) is the placement it implies.
std::optional<ComputeViolation> check_compute(const ComputeGrid& compute, int num_stages, int microbatches,
                                              std::vector<int>* stage_to_rank);

// add_send_recv's walk: places the actions round-robin over ranks as their inputs become available, with a SEND
// after each producer and its RECV on the receiver. Returns the (rank, index in its list) of every rank that cannot
// go on when the lists deadlock (then `out` is left alone), else an empty list and the lowered lists in `out`.
std::vector<std::pair<int, size_t>> place_send_recv(const ActionLists& actions, const std::vector<int>& stage_to_rank,
                                                    ActionLists* out);

// Replay of lowered lists: validate_lowered's dry run and simulate() share it. Each rank executes its list in
// order. A RECV cannot be processed before its matching SEND was issued (that is the only wait); everything else a
// rank reaches must already have its inputs on that rank, or the list is wrong (an error naming the action).
struct ReplayOptions {
  const SimCosts* costs = nullptr;  // null: dry run only
  bool recv_blocks_rank = false;    // time model: the RECV itself waits (true) or the consumer does (false)
};

struct ReplayTimes {
  std::vector<double> clock;
  std::vector<std::vector<std::pair<double, double>>> spans;
  std::vector<double> busy;
};

ReplayTimes replay(const ActionLists& lists, const std::vector<int>& stage_to_rank, const ReplayOptions& options);

}  // namespace fsdp::pipeline::detail
