#pragma once
// Collectives in libtorch's profiler (Kineto; torch::autograd::profiler::enableProfiler). When a profiler listens
// on the thread that issues a collective:
//   - the transfer becomes an event "fsdp::<collective>" from the moment it was issued to the moment it completed,
//     with "bytes=... group=... | <description>" as its backend argument. It is reported by a "lane" thread per
//     collective kind and group that waits for the transfer, so all-gathers, reduce-scatters, all-reduces, sends
//     and receives each get a track of their own, as NCCL kernels get a stream of their own in a GPU trace. It
//     goes through libtorch's reportBackendEventToActiveKinetoProfiler (events that ran outside the profiled
//     threads, with their own times): the bytes move on Gloo's transport threads, which the profiler does not see.
//   - the training thread's Work::wait is a range "fsdp::wait(<collective>)": how long it was held up.
// The trace then shows what was in flight while compute ran, and what of it the training thread waited for.
//
// Nothing here costs anything while no profiler listens: one check of libtorch's callback list per collective.
//
// Private to src/comm.

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace fsdp::comm {

// The profiler state of the calling thread when a profiler records there, to carry into the lane thread
// (at::ThreadLocalStateGuard); nullopt otherwise.
std::optional<at::ThreadLocalState> listening_profiler();

// The profiler's clock (system_clock, microseconds).
int64_t profiler_clock_us();

// What a transfer event says about its collective.
struct TransferInfo {
  const char* collective = "";  // "all_gather_into_tensor", "send", ...
  std::string group;            // the group's name
  int group_size = 1;
  int64_t bytes = 0;            // this rank's input bytes, as CollectiveSpan::bytes
  std::string what;             // the Work's description: element counts, dtype, peer, group members
};

// One profiled transfer: shared by the task that waits for it (which stamps completed_us) and the lane task that
// reports it.
struct TransferWatch {
  TransferInfo info;
  at::ThreadLocalState profiler;  // the issuing thread's, carried to the lane
  int64_t issued_us = 0;
  std::atomic<int64_t> completed_us{0};
  TransferWatch(TransferInfo info, at::ThreadLocalState profiler)
      : info(std::move(info)), profiler(std::move(profiler)), issued_us(profiler_clock_us()) {}
};

// Reports "fsdp::<collective>" from issued_us to completed_us to the profiler carried in `watch`, on the calling
// thread's track.
void report_transfer(const TransferWatch& watch);

// "fsdp::wait(<collective>)" on the calling thread while it lives (Work::wait), when a profiler listens here.
class WaitRange {
 public:
  explicit WaitRange(const char* collective);
  WaitRange(const WaitRange&) = delete;
  WaitRange& operator=(const WaitRange&) = delete;

 private:
  at::RecordFunction range_{at::RecordScope::USER_SCOPE};
};

// The lane thread's name for a collective kind on group `group` ("ag world", "rs dp_shard", ...; pthread names
// hold 15 characters).
std::string lane_name(const char* collective, const std::string& group);

}  // namespace fsdp::comm
