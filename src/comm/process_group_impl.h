#pragma once
// Private: the state behind fsdp::ProcessGroup and fsdp::Work. Only src/comm/*.cpp include this header, so
// c10d's headers never leak into the public API.

#include "comm/buffer_pool.h"
#include "comm/progress_thread.h"

#include <fsdp/process_group.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

struct ProcessGroup::Impl {
  // Null for size-1 groups: every collective takes the local fast path, so no communicator is needed.
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0;
  int size = 1;
  std::string name;
  std::vector<int> global_ranks;
  std::string backend_name;
  c10::Device device{c10::kCPU};
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  CommStats stats;
  // Point-to-point tag of the next all-gather exchange. Advances identically on every rank of the group
  // because collectives are called in the same order everywhere.
  uint32_t next_p2p_tag = 1;
  // Drives the reduce-scatter's local reductions off the calling thread; started on first use. Declared
  // after `backend` so it is joined (its tasks finished) before the backend goes.
  comm::BufferPool scratch;  // reduce-scatter receive slots and accumulators, reused across calls
  std::unique_ptr<comm::ProgressThread> progress;
  comm::ProgressThread& progress_thread();

  // The group's key space in the rendezvous store (null for size-1 groups) and the number of collectives issued
  // so far (advances identically on every rank): when a collective fails, the ranks that never reached it are
  // found through the store (comm::missing_ranks).
  c10::intrusive_ptr<c10d::Store> store;
  mutable uint64_t collectives_issued = 0;

  // "group 'world' (world ranks [0, 1, 2], this rank 1)" — used in every error message.
  std::string describe() const;
};

// The message of a caught exception without c10::Error's backtrace (we wrap it in our own context).
inline const char* message_of(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  return ce ? ce->what_without_backtrace() : e.what();
}

// Starts a backend call; launch failures (e.g. the backend rejects the dtype) get the same context as wait()
// failures.
template <typename F>
c10::intrusive_ptr<c10d::Work> launch(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: ", what, " failed to start: ", message_of(e));
  }
}

struct Work::Impl {
  std::string what;  // "reduce_scatter_tensor(Sum, 8 x BFloat16) on group '...' (...)"
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  std::function<void()> on_complete;  // local post-processing once `pending` is done
  std::shared_ptr<comm::TaskState> task;  // work done on the group's progress thread (e.g. the local sums)
  std::chrono::milliseconds timeout{0};
  bool done = false;
  std::string error;  // non-empty once failed: later wait() calls rethrow the same failure
  // For the diagnosis of a failure (see comm::stamp): the group's store, members and this collective's number.
  c10::intrusive_ptr<c10d::Store> store;
  std::vector<int> global_ranks;
  int rank = 0;
  uint64_t seq = 0;
};

namespace comm {
// Gives `w` the group's store, members and the next collective number (call once per collective that reaches
// the backend, in the same order on every rank).
void stamp(Work::Impl& w, const ProcessGroup::Impl& g);
// After `w` failed: every rank that fails records in the store which collective it was stuck in; this waits a
// short grace for the other members' records and returns " — world rank(s) [2] never reached collective #7 of
// this group (...)" naming the ranks that are missing or elsewhere; "" when nothing can be said. Bounded in time
// even when the store's host is the rank that is gone.
std::string missing_ranks(const Work::Impl& w);

// Reduce-scatter as a direct exchange reduced piece by piece as it arrives (comm/reduce_scatter.cpp). Called
// by ProcessGroup::reduce_scatter_tensor after its checks, for groups of more than one rank and non-empty input.
Work pipelined_reduce_scatter(ProcessGroup::Impl& g, std::string what, const at::Tensor& output,
                              const at::Tensor& input, ReduceOp op);
}  // namespace comm

}  // namespace fsdp
