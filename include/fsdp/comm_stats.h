#pragma once
// What a process group's collectives did: per-group counters and a timeline of when each collective ran. For
// tests and benchmarks (analytic byte counts, "FSDP issued exactly these collectives", overlap measured from
// timestamps) and for tools that profile; a training program needs none of it, so it is kept off
// fsdp::ProcessGroup.
//
// Everything here is per group (it lives and dies with the ProcessGroup): there are no process-wide counters.

#include <fsdp/process_group.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

// Calls per collective since the last reset_comm_stats. bytes_sent counts what this rank puts on the wire for
// the algorithm the layer runs (e.g. (size-1)/size of the input for reduce-scatter), so tests can compare
// against the analytic optimum. Calls are counted also when they take a local fast path (size-1 group, empty
// tensor); those send nothing.
struct CommStats {
  int64_t all_gather_calls = 0;
  int64_t reduce_scatter_calls = 0;
  int64_t all_reduce_calls = 0;
  int64_t broadcast_calls = 0;
  int64_t all_to_all_calls = 0;
  int64_t barrier_calls = 0;
  int64_t bytes_sent = 0;       // by every call, point-to-point sends included
  int64_t send_calls = 0;       // point-to-point
  int64_t recv_calls = 0;
  int64_t p2p_bytes_sent = 0;
  int64_t p2p_bytes_received = 0;
};

// The group's counters; the reference stays valid (and current) while the group lives.
const CommStats& comm_stats(const ProcessGroup& group);
void reset_comm_stats(ProcessGroup& group);

// Collectives issued on this group so far that communicate (not the local fast paths; reset_comm_stats leaves it
// alone). Ranks running the same program in step agree on it: a cheap check that they stopped at the same point.
int64_t collectives_called(const ProcessGroup& group);

// When one collective ran.
struct CollectiveSpan {
  using Clock = std::chrono::steady_clock;
  std::string collective;       // "all_gather_into_tensor", "reduce_scatter_tensor", ...
  int64_t bytes = 0;            // this rank's input bytes
  Clock::time_point issued;     // the call returned its Work
  Clock::time_point completed;  // the transfers (and any local reduction) finished; {} while running
  // The caller inside Work::wait(): wait_end - wait_begin is the time the collective kept it waiting
  // (exposed communication). Both {} until waited.
  Clock::time_point wait_begin, wait_end;
};

// Records a CollectiveSpan for every later collective of `group` that communicates (not the local fast paths).
// Completion is stamped by an observer thread that waits on the transfers, so it is when they finished, not
// when the caller came to wait. Off by default; record_timeline(group, false) drops what was recorded.
void record_timeline(ProcessGroup& group, bool enable);
std::vector<CollectiveSpan> comm_timeline(const ProcessGroup& group);

// While libtorch's profiler records, each collective's transfer is handed to it by a thread of the group once the
// transfer completes (docs/comm.md, "Collectives in libtorch's profiler"), a little after the caller's wait. Blocks
// until every collective issued on `group` so far has been handed over, or `timeout` passed (false): call it before
// stopping the profiler, or the window's last transfers — on a busy machine, all of them — miss the trace.
bool flush_profiler_reports(ProcessGroup& group, std::chrono::milliseconds timeout);

}  // namespace fsdp
