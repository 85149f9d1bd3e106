#pragma once
// The streams FSDP's communication runs on and the events that order them (Python's FSDPCommContext,
// torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py). Device-generic: c10::Stream and c10::Event
// through the device's guard implementation, no CUDA header.
//
// On a device with streams (CUDA), one set per root, shared by every group under it:
//   all_gather_copy_in  the shards are cast/copied into the all-gather input here, so the next group's copy-in
//                       overlaps the current all-gather (high priority);
//   all_gather          the all-gathers are issued here, so they overlap forward/backward compute (high priority);
//   reduce_scatter      gradient packing, pre-division and the reduce-scatters (high priority);
//   all_reduce          HSDP's all-reduce across replicas, apart from the reduce-scatters (normal priority).
// The compute stream (the current one) waits on events recorded on these streams, never on the whole stream.
//
// On a device without streams (CPU, or any device whose guard implementation has no stream pool) every one of
// them *is* the current stream and events are never recorded: the code runs exactly as it did before streams
// existed (one stream runs everything in issue order, so there is nothing to wait for).
//
// Buffers used across streams are not protected with record_stream (which delays reuse until the allocator
// polls events, and costs a query per free). A HeldBuffer keeps the buffer alive until the stream that will
// reuse its memory was made to wait for an event recorded after the last use; only then is it released.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace c10 {
struct Event;
}

namespace fsdp::detail {

// An event recorded on one stream for other streams to wait on. Empty (waiting on it does nothing) where there
// are no separate streams. Copyable: the copies share one event.
class StreamEvent {
 public:
  bool recorded() const { return event_ != nullptr; }

 private:
  friend class CommStreams;
  std::shared_ptr<c10::Event> event_;
};

class CommStreams {
 public:
  // The streams of `device`: separate ones where its guard implementation has a stream pool, else none.
  explicit CommStreams(c10::Device device);

  bool separate() const { return separate_; }
  c10::Device device() const { return device_; }
  c10::Stream current() const;  // the compute stream: whatever is current on the device now
  // Each is current() when !separate().
  c10::Stream all_gather_copy_in() const { return separate_ ? copy_in_ : current(); }
  c10::Stream all_gather() const { return separate_ ? all_gather_ : current(); }
  c10::Stream reduce_scatter() const { return separate_ ? reduce_scatter_ : current(); }
  c10::Stream all_reduce() const { return separate_ ? all_reduce_ : current(); }

  // An event on `stream` after the work issued there so far (empty without separate streams).
  StreamEvent record(c10::Stream stream);
  // `waiter` runs later work only after `event` (nothing on the host blocks). Counted even when empty.
  void wait(c10::Stream waiter, const StreamEvent& event);
  // `waiter` waits for everything issued on `waited` so far (an event, not a device-wide sync).
  void wait_stream(c10::Stream waiter, c10::Stream waited);
  // The host thread blocks until `event` completed (grads copied to the CPU before the optimizer reads them).
  void synchronize(const StreamEvent& event);

  // For tests: how many waits were issued / events recorded since construction.
  int64_t waits_issued() const { return waits_issued_; }
  int64_t events_recorded() const { return events_recorded_; }

 private:
  c10::Device device_;
  bool separate_ = false;
  c10::Stream copy_in_, all_gather_, reduce_scatter_, all_reduce_;
  int64_t waits_issued_ = 0;
  int64_t events_recorded_ = 0;
};

// Makes `stream` (when given) the current stream of its device while alive.
// (Allocations made under it belong to `stream` in a caching allocator.)
class CommStreamGuard {
 public:
  // nullopt: no stream to switch to (the caller runs on the current stream).
  explicit CommStreamGuard(std::optional<c10::Stream> stream) {
    if (stream) guard_.reset_stream(*stream);
  }

 private:
  c10::OptionalStreamGuard guard_;
};

// A buffer still used by work on some stream, kept until the streams that reuse its memory waited for the
// event recorded after that use (instead of record_stream). Python's AllGatherState / ReduceScatterState.
class HeldBuffer {
 public:
  void hold(at::Tensor buffer, StreamEvent event);
  // Every stream of `waiters` waits for the event, then the buffer is released (in that order: a caching
  // allocator may hand the memory to the next allocation on those streams as soon as it is released).
  void release(CommStreams& streams, const std::vector<c10::Stream>& waiters);
  bool holding() const { return buffer_.defined(); }

 private:
  at::Tensor buffer_;
  StreamEvent event_;
};

// What a root shares with every group under it (created at the root's lazy init).
struct CommContext {
  explicit CommContext(c10::Device device) : streams(device) {}
  CommStreams streams;
  // The previous forward all-gather's output, until the next group's copy-out: lets that copy-out overlap the
  // next all-gather without the two sharing memory ([Note: Overlapping all-gather copy-in and all-gather]).
  HeldBuffer all_gather_state;
  // The last reduce-scatter's input, until the next reduction starts on the compute stream's order.
  HeldBuffer reduce_scatter_state;
};

}  // namespace fsdp::detail
