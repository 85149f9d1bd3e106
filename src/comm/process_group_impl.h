#pragma once
// Private: the state behind fsdp::ProcessGroup and fsdp::Work. Only src/comm/*.cpp include this header, so
// c10d's headers never leak into the public API.

#include "comm/buffer_pool.h"
#include "comm/collective_backend.h"
#include "comm/profiling.h"
#include "comm/progress_thread.h"
#include "util/exception_message.h"

#include <fsdp/comm_stats.h>
#include <fsdp/process_group.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace comm {
// The first collective failure of a group on this rank, shared by the group and its Work items (a Work may
// outlive its group and fail in wait() on any thread).
struct FailureRecord {
  std::mutex mutex;
  std::optional<std::string> first;
  void record(const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!first) first = error;
  }
};
// The spans record_timeline (fsdp/comm_stats.h) asked for. Their time points are stamped from several threads
// (caller, observer, progress thread), always under `mutex`.
struct SpanLog {
  std::mutex mutex;
  std::vector<std::shared_ptr<CollectiveSpan>> spans;
  void stamp(CollectiveSpan& span, CollectiveSpan::Clock::time_point CollectiveSpan::*field) {
    const auto now = CollectiveSpan::Clock::now();
    std::lock_guard<std::mutex> lock(mutex);
    span.*field = now;
  }
};
// A recording group's log and the thread that waits on transfers to stamp their completion. Tasks capture
// only the log, never the timeline, so the observer is never destroyed from its own thread.
struct Timeline {
  std::shared_ptr<SpanLog> log = std::make_shared<SpanLog>();
  ProgressThread observer{"fsdp-timeline"};
};
}  // namespace comm

struct ProcessGroup::Impl {
  int rank = 0;
  int size = 1;
  std::string name;
  std::vector<int> global_ranks;
  std::string backend_name;
  c10::Device device{c10::kCPU};
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // How this group's collectives move bytes (comm/collective_backend.h), chosen when the group was created. It
  // owns the c10d communicator (none for size-1 groups). Declared before `progress` so the progress thread is
  // joined (its tasks finished) before the communicator goes.
  std::unique_ptr<comm::CollectiveBackend> collectives;
  CommStats stats;
  int64_t store_exchanges = 0;  // numbers exchange_through_store's calls: the n-th meets the n-th everywhere
  // Point-to-point tag of the next all-gather exchange. Advances identically on every rank of the group
  // because collectives are called in the same order everywhere.
  uint32_t next_p2p_tag = 1;
  comm::BufferPool scratch;  // reduce-scatter receive slots and accumulators, reused across calls
  // Drives the reduce-scatter's local reductions off the calling thread; started on first use (see
  // `collectives` for why it is declared after it).
  std::unique_ptr<comm::ProgressThread> progress;
  comm::ProgressThread& progress_thread();
  // While a profiler records (comm/profiling.h): one thread per collective kind that waits on its transfers and
  // reports them to the profiler, started on first use. After `progress` for the same reason.
  std::map<std::string, std::unique_ptr<comm::ProgressThread>> lanes;
  comm::ProgressThread& lane(const char* collective);
  std::unique_ptr<comm::Timeline> timeline;  // null unless recording

  // The group's key space in the rendezvous store (null for size-1 groups) and the number of collectives issued
  // so far (advances identically on every rank): when a collective fails, the ranks that never reached it are
  // found through the store (comm::missing_ranks).
  c10::intrusive_ptr<c10d::Store> store;
  mutable uint64_t collectives_issued = 0;
  std::shared_ptr<comm::FailureRecord> failures = std::make_shared<comm::FailureRecord>();

  // "group 'world' (world ranks [0, 1, 2], this rank 1)" — used in every error message.
  std::string describe() const;
};

using detail::message_of;  // util/exception_message.h: errors of comm wrap the backend's message in context

// Starts a backend call; launch failures (e.g. the backend rejects the dtype) get the same context as wait()
// failures.
template <typename F>
c10::intrusive_ptr<c10d::Work> launch(const std::string& what, F&& f) {
  // Without profiler ranges: c10d's Work would record its own ("gloo:send") from this call to the transfer's end on
  // the calling thread's track, drawn over whatever that thread computes meanwhile. comm::trace shows the same
  // transfer, with its sizes, on a track of its own (comm/profiling.h).
  at::DisableRecordFunctionGuard no_backend_ranges;
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
  // Work::wait blocks the CPU until done (Gloo). NCCL's wait only makes the current stream wait for the
  // collective's stream (no CPU polling); its watchdog enforces the timeout.
  bool cpu_blocking_wait = true;
  bool done = false;
  std::string error;  // non-empty once failed: later wait() calls rethrow the same failure
  // For the diagnosis of a failure (see comm::stamp): the group's store, members and this collective's number.
  c10::intrusive_ptr<c10d::Store> store;
  std::vector<int> global_ranks;
  int rank = 0;
  uint64_t seq = 0;
  std::shared_ptr<comm::FailureRecord> group_failures;  // the group's record, told of this failure
  // Recording (record_timeline): this collective's span and where it lives.
  std::shared_ptr<comm::SpanLog> span_log;
  std::shared_ptr<CollectiveSpan> span;
  // Profiling (comm/profiling.h), set by comm::trace: the collective's name (for the wait range) and, while a
  // profiler listens, what its transfer event will say.
  const char* collective = "collective";
  std::shared_ptr<comm::TransferWatch> watch;  // null unless a profiler listened when it was issued

  // How long any thread waits on this work's transfers or task before giving up. Gloo enforces the timeout itself
  // on every transfer; this is a backstop for work that never started (e.g. queued behind a stuck collective),
  // with slack so that Gloo's more precise message wins.
  std::chrono::milliseconds backstop() const {
    return timeout + std::max(std::chrono::milliseconds(1000), timeout / 10);
  }
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

// Reduce-scatter as a direct exchange over `communicator`'s point-to-point, reduced piece by piece as it arrives
// (comm/reduce_scatter.cpp). For Gloo groups of more than one rank on CPU tensors, non-empty input.
Work pipelined_reduce_scatter(ProcessGroup::Impl& g, const c10::intrusive_ptr<c10d::Backend>& communicator,
                              std::string what, const at::Tensor& output, const at::Tensor& input, ReduceOp op);
// Called by every collective that communicates, just before it returns its Work: when the group records a
// timeline, opens the span; when a profiler listens on the calling thread, prepares w.watch (comm/profiling.h).
// In either case hands the waiting on `w.pending` to a task on another thread — the collective's lane thread
// while profiling, else the timeline's observer — that stamps the completion when it happens (the training
// thread's wait() then waits for that task, or runs it itself if it has not started: only one thread ever waits
// on a transfer, as Gloo's point-to-point requires), then report_when_done. Work that already runs a task (the
// reduce-scatter) stamps its own completion and calls report_when_done once its task exists: pass `own_task`.
void trace(ProcessGroup::Impl& g, Work::Impl& w, const char* collective, int64_t bytes, bool own_task = false);
// While profiling (w.watch): a task on the lane thread of w's collective that waits, without claiming it, for
// w.task to finish, then reports the transfer (the lane's track, whoever ran w.task). Failed transfers are not
// reported: Work::wait reports the failure.
void report_when_done(ProcessGroup::Impl& g, const Work::Impl& w);
}  // namespace comm

namespace detail {
// The one door from a public ProcessGroup to its state (friend of ProcessGroup): comm_stats.h's functions and
// comm/store_exchange.h use it.
struct ProcessGroupAccess {
  static ProcessGroup::Impl& impl(const ProcessGroup& group) { return *group.impl_; }
};
}  // namespace detail

}  // namespace fsdp
