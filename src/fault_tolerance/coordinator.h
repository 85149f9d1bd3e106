#pragma once
// Private: the quorum protocol over the coordinator's c10d store (docs/reliability.md, "Replica-group fault
// tolerance"). Every decision that several processes must share is made by one atomic store operation (add hands out
// join positions, compareSet closes a round and records its commit decision), and everyone reads that one value
// back — so no two members can disagree on a membership or a commit, whatever the timing.
//
// Keys, all under "fsdp-ft/":
//   replicas                    append-only list "id,id,..." of the replica ids ever seen (whose heartbeats to watch)
//   size/<replica id>           the number of ranks of that replica group (written by its rank 0 before it is listed)
//   hb/<replica id>/<rank>      a counter each rank's heartbeat thread bumps every 100 ms; a replica group is alive
//                               while every one of its ranks beats (a group with one hung rank cannot train)
//   latest                      the newest closed round (a hint for where to join)
//   round/<q>/joined            add() counter: the n-th joiner of round q gets position n
//   round/<q>/member/<n>        "replica_id step incarnation" of the joiner at position n
//   round/<q>/closed            the number of positions in the membership (compareSet from absent, once)
//   round/<q>/vote/<i>/<rank>   "1" / "0": the commit vote of member i's rank
//   round/<q>/decision          "commit" / "abort: <why>" (compareSet from absent, once)
//   pg/<q>/shard<s>/            key space of the quorum process group made in round q for shard index s

#include <fsdp/fault_tolerance.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::ft {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// A client connection to the coordinator's TCPStore at "host:port" (throws naming the address when unreachable
// within `timeout`).
StorePtr connect_coordinator(const std::string& address, std::chrono::milliseconds timeout);

struct Member {
  int replica_id = -1;
  int64_t step = 0;
  uint64_t incarnation = 0;  // random per Manager: a restarted replica is a new member even with the same id
  int64_t position = 0;      // join position in its round
  bool operator==(const Member& o) const { return replica_id == o.replica_id && incarnation == o.incarnation; }
};

struct ClosedRound {
  int64_t id = -1;
  std::vector<Member> members;  // sorted by replica id; one per id (the latest join of that id)
  int64_t positions = 0;        // join positions the round closed over (the value of its "closed" key)
};

// Bumps hb/<replica id>/<rank> every 100 ms on its own store connection (so that a Gloo rendezvous blocking the main
// connection cannot starve it) until destroyed. A process that is killed or stopped stops beating.
class Heartbeat {
 public:
  Heartbeat(StorePtr store, int replica_id, int rank);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void run();
  StorePtr store_;
  std::string key_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;  // last: started once everything it reads exists
};

class Coordinator {
 public:
  Coordinator(StorePtr store, const ManagerOptions& options);

  // Rank 0 of a replica group: joins rounds after `last_round` until one closes with this replica inside; `missed`
  // counts the rounds that closed without it. Throws when none does within quorum_timeout.
  ClosedRound join(const Member& me, int64_t last_round, int64_t& missed);
  // A closed round's membership (every rank of a member reads the same).
  ClosedRound read_round(int64_t id, int64_t positions);
  // The quorum group of round-1 can be kept: same members (same incarnations) and round-1 committed.
  bool keeps_group(const ClosedRound& round);
  // The commit vote of one rank; returns the round's decision (the same for every voter) and, for an abort, why.
  struct Decision {
    bool commit = false;
    std::string why;
  };
  Decision vote(int64_t round, int member_index, int rank, int num_members, int group_size, bool ok);

  const StorePtr& store() const { return store_; }
  static std::string group_prefix(int64_t round, int shard) {
    return "fsdp-ft/pg/" + std::to_string(round) + "/shard" + std::to_string(shard) + "/";
  }

 private:
  bool try_round(int64_t q, const Member& me, std::chrono::steady_clock::time_point deadline, ClosedRound& out);
  std::vector<int> live_replicas(std::chrono::steady_clock::time_point now);

  StorePtr store_;
  ManagerOptions options_;
  // Heartbeat observation: the last counter seen per (replica id, rank) and when it last changed (this process's
  // clock).
  struct Seen {
    int64_t beats = -1;
    std::chrono::steady_clock::time_point changed;
  };
  std::map<std::pair<int, int>, Seen> seen_;
  std::chrono::steady_clock::time_point watching_since_;
};

}  // namespace fsdp::ft
