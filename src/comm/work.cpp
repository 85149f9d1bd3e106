// fsdp::Work: waits on the c10d work items of one collective, runs its local post-processing, and turns any
// failure (Gloo timeout, peer gone, c10d's own wait timeout) into a c10::Error that names the collective and
// the group, so a stuck or broken collective surfaces as an exception instead of a hang.

#include "comm/process_group_impl.h"

#include <c10/util/Exception.h>

namespace fsdp {

Work::Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Work::is_completed() const {
  if (!impl_ || impl_->done) return true;
  for (const auto& w : impl_->pending) {
    if (!w->isCompleted()) return false;
  }
  if (impl_->task && !impl_->task->done()) return false;
  // The transfers are done; the local post-processing runs in wait().
  return impl_->on_complete == nullptr;
}

void Work::wait() {
  if (!impl_) return;
  Impl& w = *impl_;
  TORCH_CHECK(w.error.empty(), w.error);
  if (w.done) return;
  if (w.span) w.span_log->stamp(*w.span, &CollectiveSpan::wait_begin);
  const comm::WaitRange range(w.collective);
  const auto backstop = w.backstop();
  try {
    for (auto& p : w.pending) {
      // NCCL: no timeout argument — with one, c10d's NCCL work busy-waits on the CPU; without, the current
      // stream waits for the collective's stream and the NCCL watchdog enforces the group's timeout.
      const bool ok = w.cpu_blocking_wait ? p->wait(backstop) : p->wait();
      TORCH_CHECK(ok, "the collective was aborted");
    }
    w.pending.clear();
    if (w.task) {
      // The task bounds each of its own waits by the timeout; this bound is the same backstop as above.
      TORCH_CHECK(w.task->wait(backstop), "its local part did not finish");
      w.task = nullptr;
    }
    if (w.on_complete) {
      w.on_complete();
      w.on_complete = nullptr;
    }
  } catch (const std::exception& e) {
    w.error = c10::str("fsdp: ", w.what, " failed (timeout ", w.timeout.count(), " ms): ", message_of(e),
                       comm::missing_ranks(w));
    if (w.group_failures) w.group_failures->record(w.error);
    w.pending.clear();
    w.task = nullptr;
    w.on_complete = nullptr;
    TORCH_CHECK(false, w.error);
  }
  w.done = true;
  if (w.span) w.span_log->stamp(*w.span, &CollectiveSpan::wait_end);
}

}  // namespace fsdp
