#pragma once
// Pipeline schedules as data: the action IR of torch.distributed.pipelining (torch 2.13), the generators of its
// schedules, the lowering passes that add FSDP and P2P actions, validation, a printable grid and an event-replay
// simulator. Pure logic: no process groups, no tensors. The pipeline runtime executes the lowered lists that
// build_schedule() returns; everything it needs to know about order is decided here.
//
// Only the standard library and c10's light headers: this header is included by the runtime and by tools.

#include <fsdp/pipeline/schedule_kind.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::pipeline {

// F, B (full backward), I (backward for inputs), W (backward for weights), then FSDP and P2P actions, then
// OVERLAP_F_B (DualPipeV: a forward of one stage and a backward of another, issued together; torch's runtime and
// ours run its two parts one after the other, forward first — what the pair allows is overlapping one part's
// communication, e.g. MoE all-to-all, with the other's compute).
enum class ActionType {
  Forward,
  Backward,
  BackwardInput,
  BackwardWeight,
  Unshard,
  Reshard,
  ReduceGrad,
  SendF,
  RecvF,
  SendB,
  RecvB,
  OverlapFB
};

// torch's spelling of the type inside an action string: "F", "B", "I", "W", "UNSHARD", "SEND_F", ...
const char* action_type_token(ActionType type);
// F, B, I, W and OVERLAP_F_B: the actions that run stage modules.
bool is_compute(ActionType type);
bool is_send(ActionType type);
bool is_recv(ActionType type);

// One step of one stage. For SEND_* the stage is the sender, for RECV_* the receiver (torch's convention):
// stage 0's activation for microbatch 3 travels as "0SEND_F3" on 0's rank and "1RECV_F3" on 1's rank.
struct Action {
  Action() = default;
  Action(int stage_index, ActionType action_type, int microbatch_index = -1)
      : stage(stage_index), type(action_type), microbatch(microbatch_index) {}

  int stage = 0;
  ActionType type = ActionType::Forward;
  int microbatch = -1;  // -1 for Unshard / Reshard / ReduceGrad (they act on the whole stage)
  // OVERLAP_F_B only: its compute actions, in the order they run (stage and microbatch are then -1, as torch's).
  std::vector<Action> sub_actions;

  // torch's string form: "2F0", "1UNSHARD", "3SEND_F1", "0REDUCE_GRAD", "(0F3;3B1)OVERLAP_F_B".
  std::string str() const;
  // The inverse of str(); throws c10::Error naming the text and the expected form on anything else.
  static Action parse(const std::string& text);
  // The actions that really run: the sub-actions of an OVERLAP_F_B, else the action itself.
  std::vector<Action> leaves() const;
  static Action overlap(Action forward, Action backward);

  bool operator==(const Action& other) const {
    return stage == other.stage && type == other.type && microbatch == other.microbatch &&
           sub_actions == other.sub_actions;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

// Case-insensitive, with torch's / TorchTitan's names: "GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B",
// "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV". An unknown name is an error that lists the valid ones.
ScheduleKind parse_schedule_name(const std::string& name);
std::string schedule_name(ScheduleKind kind);
// 1 for GPipe and 1F1B (one stage per rank), 2 for the multi-stage schedules (ZBV and DualPipeV need exactly 2).
int default_stages_per_rank(ScheduleKind kind);
// GPipe and 1F1B: torch runs a hand-written loop per rank (PipelineScheduleSingle); the others are executed from
// the lowered action lists (_PipelineScheduleRuntime).
bool is_single_stage_kind(ScheduleKind kind);

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int pp = 1;               // pipeline ranks
  int stages_per_rank = 1;  // v
  int microbatches = 1;     // m
};

// Per rank: compute-only list, nullopt marks an idle step (a bubble in torch's IR; display only).
using ComputeGrid = std::vector<std::vector<std::optional<Action>>>;
// Per rank: the lowered list the runtime walks in order.
using ActionLists = std::vector<std::vector<Action>>;

struct PipelineSchedule {
  ScheduleSpec spec;
  int num_stages = 0;
  std::vector<int> stage_to_rank;  // loop schedules: stage s on rank s % pp; ZBV, DualPipeV: the V (0..p-1, p-1..0)
  ComputeGrid compute;             // F/B/I/W/OVERLAP_F_B only
  ActionLists actions;             // + UNSHARD / RESHARD / REDUCE_GRAD / SEND_* / RECV_*

  // The stages this rank holds, ascending.
  std::vector<int> stages_of_rank(int rank) const;
};

// torch's _PipelineScheduleRuntime._load_csv (format "compute_only", as TorchTitan's pipeline_parallel_schedule_csv
// is read, and as torch's _dump_csv(format="compute_only") writes): one row per pipeline rank, one cell per step,
// each an action string ("0F1", "1I0", "(0F3;3B1)OVERLAP_F_B") or empty for an idle step. The lists are checked
// with validate_compute's rules, the stage placement is inferred from them (any, not only loop or V), a deadlock is
// found before anything runs, then they are lowered as a built schedule is. An error is one line that names the
// file, the row (rank + 1), the column (step + 1), the cell and the rule broken.
PipelineSchedule load_schedule_csv(const std::string& path, int pp, int num_stages, int microbatches);
// The same from the file's text; `source` names it in errors.
PipelineSchedule parse_schedule_csv(const std::string& text, const std::string& source, int pp, int num_stages,
                                    int microbatches);

// Checks the spec (the reasons torch refuses it, and a few it would not catch), generates the compute lists,
// validates them, lowers them and validates the lowered lists. Throws c10::Error with the reason.
PipelineSchedule build_schedule(const ScheduleSpec& spec);

// Stage -> rank maps. "loop": s % pp. V: ranks 0..pp-1, then pp-1..0, and so on (num_stages % pp == 0).
std::vector<int> loop_stage_to_rank(int pp, int num_stages);
std::vector<int> v_stage_to_rank(int pp, int num_stages);

// torch's _validate_schedule rules, stricter where torch uses sets: one list per rank; every stage on exactly one
// rank; stage and microbatch in range; B and I after the F of the same stage and microbatch, W after its I; each
// (stage, microbatch) has exactly one F and either one B or one I and one W. Errors print the whole grid with
// "<-- ERROR HERE" on the offending step. Returns the stage -> rank map the lists imply.
std::vector<int> validate_compute(const ComputeGrid& compute, int pp, int num_stages, int microbatches);

// Checks a lowered schedule:
//  - actions only for stages of their own rank; the compute actions pass validate_compute;
//  - every SEND has its RECV on the neighbour stage's rank and vice versa, and between each pair of ranks the
//    receives are posted in the order of the sends (P2P between two ranks matches in issue order);
//  - no SEND or RECV between stages on the same rank (they hand tensors over in memory);
//  - a stage computes only between its UNSHARD and its RESHARD; no double UNSHARD, no RESHARD without one, no
//    UNSHARD left unused or open at the end;
//  - REDUCE_GRAD once per stage, after its m-th B/W, while unsharded, and no B/W after it;
//  - a dry run (each rank executes its list in order; a RECV blocks until the matching SEND was issued; a compute
//    action needs its input received or produced locally; a SEND needs the compute that produced it) finishes;
//    otherwise the error names every rank's blocked action.
void validate_lowered(const ActionLists& actions, const std::vector<int>& stage_to_rank, int microbatches);

// The lowering passes of torch's _prepare_schedule_with_comms, usable on their own (tests, CSV-like input).
// Per rank: UNSHARD each stage before it computes (prefetching the next max_active_stages distinct stages) and
// RESHARD a stage once it is no longer among them.
std::vector<Action> add_unshard_reshard(const std::vector<std::optional<Action>>& compute,
                                        int max_active_stages = 3);
// Per rank: REDUCE_GRAD(s) right after the m-th B or W of stage s.
std::vector<Action> add_reduce_grad(const std::vector<Action>& actions, int microbatches);
// All ranks: SEND after each compute whose neighbour stage lives elsewhere, its RECV appended to the receiver's
// list at the same moment (round-robin over ranks, one action per rank per round).
ActionLists add_send_recv(const ActionLists& actions, const std::vector<int>& stage_to_rank);
// The three passes in torch's order.
ActionLists lower_compute(const ComputeGrid& compute, const std::vector<int>& stage_to_rank, int microbatches);

// A printable grid, one column per rank, one row per step: the compute lists (idle steps blank) or, with
// with_comms, the lowered lists.
std::string format_schedule(const PipelineSchedule& schedule, bool with_comms);
// The same for any grid; error_step >= 0 marks that row with "<-- ERROR HERE" (as torch's error messages do).
std::string format_grid(const ComputeGrid& grid, int error_step = -1);

// Costs for simulate(). Compute costs are per action of one stage; stage_scale, when not empty, multiplies them
// per stage (size num_stages). Communication actions take no time on the rank that issues them; a RECV's data
// arrives p2p_latency after its SEND was issued. Unshard / reshard / reduce_grad occupy the rank for their cost.
// An OVERLAP_F_B costs the sum of its parts: the simulator models no communication inside a stage (the MoE
// all-to-all that DualPipeV hides under the other part's compute), so the pair gains nothing here.
struct SimCosts {
  // Where a rank waits for received data. false (torch's runtime): the RECV is posted without waiting and the
  // compute that consumes it waits — the runtime schedules' lowering posts RECVs early, so this matters. true: the
  // rank stalls at the RECV itself (a runtime that waits on every irecv where it is posted); with torch's lowering
  // this costs Interleaved1F1B p=4 m=8 a bubble of 0.49 instead of 0.16.
  bool recv_waits_in_place = false;
  double forward = 1.0;
  double backward = 2.0;        // a full backward B
  double backward_input = 1.0;  // I
  double backward_weight = 1.0; // W
  double p2p_latency = 0.0;
  double unshard = 0.0;
  double reshard = 0.0;
  double reduce_grad = 0.0;
  std::vector<double> stage_scale;

  double cost_of(const Action& action) const;
};

struct SimResult {
  double makespan = 0.0;
  std::vector<double> busy, idle;                             // per rank: time in F/B/I/W, makespan - busy
  std::vector<std::vector<std::pair<double, double>>> spans;  // per rank, per lowered action: start, end
  double bubble_fraction = 0.0;                               // sum(idle) / (pp * makespan)
};

// Event replay of the lowered lists: each rank runs its list in order; a compute action takes its cost; SEND is
// non-blocking; a RECV's data is there at its SEND's time + latency, and the consumer (or, with
// recv_waits_in_place, the RECV) waits for it. Runs validate_lowered first (so a deadlock or a broken hand-edited
// list is an error, not a result).
SimResult simulate(const PipelineSchedule& schedule, const SimCosts& costs);

}  // namespace fsdp::pipeline
