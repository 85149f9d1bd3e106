#pragma once
// Fault tolerance across replica groups (torchft's Manager, docs/reliability.md "Replica-group fault tolerance").
//
// Each replica group — the ranks that together hold one copy of the model (FSDP inside the group) — is a job of its
// own (its own fsdprun, its own world). The groups meet in a coordinator: a c10d TCPStore served by a process that no
// replica's failure takes down (apps/fsdp-lighthouse). Every step:
//   1. start_quorum(step): the replica groups that are alive agree on who takes part in this step (the quorum) and
//      whether some must first copy the state of an up-to-date member (healing, send_state / receive_state);
//   2. allreduce_average(gradient): averages over the quorum's members, through a process group that connects the
//      ranks with the same shard index across the members; failures are recorded, not thrown;
//   3. should_commit(ok): every rank of every member votes; the step is applied (optimizer step, step + 1) only if
//      all voted ok in time. Otherwise every survivor drops it and retries the same step with the next quorum.

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::ft {

struct ManagerOptions {
  int replica_id = -1;     // this replica group's id (>= 0), unique among the groups of the run
  std::string lighthouse;  // the coordinator's "host:port"; empty = environment variable FSDP_LIGHTHOUSE
  int min_replicas = 1;    // a quorum needs at least this many replica groups
  // When this many replica groups have joined a round it closes at once (0 = unknown). Otherwise a round closes as
  // soon as every member of the previous quorum has joined or is gone (heartbeat_timeout), or join_timeout after
  // this replica joined.
  int expected_replicas = 0;
  std::chrono::milliseconds join_timeout{std::chrono::seconds(2)};
  // Every rank of a replica group beats every 100 ms from its first start_quorum on (not while it is still starting
  // up). A group some of whose ranks have not beaten for this long is gone: a round stops waiting for it, and the
  // majority rule (more than half of the live groups must join) leaves it out.
  std::chrono::milliseconds heartbeat_timeout{std::chrono::seconds(1)};
  // How long start_quorum waits for a quorum of min_replicas before it throws.
  std::chrono::milliseconds quorum_timeout{std::chrono::minutes(2)};
  // Connecting the quorum's process group, each collective over it, healing transfers, and the commit vote.
  std::chrono::milliseconds timeout{std::chrono::seconds(10)};
};

// The outcome of start_quorum, the same on every rank of every member (but replica_index and the healing fields,
// which are this replica's).
struct Quorum {
  int64_t id = -1;                  // the round that formed it; changes every step
  std::vector<int> replica_ids;     // members, sorted
  int replica_index = -1;           // this replica's position in replica_ids (its rank in the quorum group)
  int64_t max_step = 0;             // the highest step among the members: the step this round trains
  bool heal = false;                // this replica is behind (its step < max_step): receive_state before training
  int heal_source = -1;             // when heal: the replica_index to receive from
  std::vector<int> heal_targets;    // replica indices this replica must send_state to (it is at max_step)
  bool group_rebuilt = false;       // the quorum's process group was made for this round (membership changed)
  int num_participants() const { return static_cast<int>(replica_ids.size()); }
};

// What a healing replica receives besides the tensors.
struct HealedState {
  int64_t step = 0;
  std::string data_position;  // opaque to the library (the sender's data loader position)
};

// One per rank of a replica group; every rank of the group makes the same calls in the same order. Not thread-safe.
// The calls follow one cycle, checked: start_quorum, then any of allreduce_average / send_state / receive_state,
// then should_commit, then start_quorum again.
class Manager {
 public:
  // `replica_group`: this replica group's own world (its ranks: shard indices); rank 0 of it joins the rounds for the
  // whole group and tells the others. Connects to the coordinator (throws naming the address when it cannot).
  Manager(ManagerOptions options, ProcessGroupPtr replica_group);
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // Joins the next round with this replica's `step` (its committed step count) and returns once this replica is a
  // member of a closed round (rounds that closed without it are skipped: it does not take part in their steps).
  // Throws when no quorum of min_replicas forms within quorum_timeout.
  const Quorum& start_quorum(int64_t step);
  const Quorum& quorum() const;

  // Sum over the quorum's members, divided by the number of participants, in place. A failure (a member gone, a
  // timeout) is recorded and makes this and every later collective of the step a no-op; the tensor's content is
  // then meaningless, and should_commit returns false.
  void allreduce_average(at::Tensor& tensor);

  // Healing, over the quorum group, rank to rank of the same shard index. A member with heal_targets sends its
  // state (tensors in an order both sides agree on, e.g. a state dict's shards by name), its step and data position
  // to each target; the healing replica receives into tensors of the same shapes and dtypes (checked). Failures are
  // recorded as in allreduce_average (receive_state then returns nothing).
  void send_state(const std::vector<at::Tensor>& tensors, int64_t step, const std::string& data_position);
  std::optional<HealedState> receive_state(std::vector<at::Tensor>& tensors);

  // The commit vote for this round: true only if every rank of every member voted ok (local_ok and no recorded
  // failure) within the timeout. One decision per round, stored atomically: every voter gets the same answer.
  bool should_commit(bool local_ok = true);

  // The first failure of the current (or just voted) step, or why the vote aborted it; empty when none.
  const std::string& error() const;
  // The quorum's process group (this rank's shard index across the members); null before the first quorum.
  ProcessGroupPtr quorum_group() const;
  // Rounds this replica joined but was left out of (it arrived after the round closed), since construction.
  int64_t rounds_missed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::ft
