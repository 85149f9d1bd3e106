#pragma once
// Private: a process group whose members meet through a store that the caller owns, not the world's rendezvous
// store — for groups across separate jobs, such as the replica groups of fault-tolerant training
// (src/fault_tolerance), which each have a world of their own and meet in a coordinator's TCPStore. Not part of the
// public API: it takes c10d's Store, which the public headers never show.

#include <fsdp/process_group.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace fsdp::comm {

struct StoreGroupSpec {
  c10::intrusive_ptr<c10d::Store> store;  // the members' common store (wrapped in a PrefixStore of `prefix`)
  std::string prefix;  // a key space no other group of that store uses, the same on every member
  std::string name;    // for errors: "quorum 3 [shard 0]"
  int rank = 0;        // this member's index, 0 <= rank < size
  int size = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};  // connecting and every later collective
  // true: a failed collective's error names the members that never reached it, found through the store after a
  // grace of up to 3 s (comm::missing_ranks). false: it fails at once — for groups where any failure ends the work
  // at hand and every second counts (a fault-tolerant quorum group: the step is discarded whoever is missing).
  bool name_missing_ranks = true;
};

// Builds the group collectively: every member calls it with the same prefix and size and its own rank; returns once
// all are connected, throws (naming the group and the timeout) when one does not come. The group works like any
// other (its global_ranks() are the member indices 0..size-1); it uses the world's backend and device when this
// process has a world, Gloo on the CPU otherwise. Not registered anywhere: it lives as long as its last holder.
ProcessGroupPtr group_over_store(const StoreGroupSpec& spec);

}  // namespace fsdp::comm
