#include "fully_shard/fsdp_streams.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace fsdp::detail {
namespace {
// The device with a concrete index (a mesh device may say just "cuda": the current device then).
c10::Device indexed(c10::Device device) {
  if (device.has_index() || !c10::impl::hasDeviceGuardImpl(device.type())) return device;
  return c10::Device(device.type(), c10::impl::VirtualGuardImpl(device.type()).getDevice().index());
}
}  // namespace

CommStreams::CommStreams(c10::Device device)
    : device_(indexed(device)),
      copy_in_(c10::Stream::DEFAULT, device_),
      all_gather_(c10::Stream::DEFAULT, device_),
      reduce_scatter_(c10::Stream::DEFAULT, device_),
      all_reduce_(c10::Stream::DEFAULT, device_) {
  // The CPU's guard implementation (registered by libtorch_cpu) has one stream and no events; meta likewise.
  // Asking the pool would throw there; skip it rather than rely on the exception.
  if (device_.is_cpu() || device_.is_meta() || !c10::impl::hasDeviceGuardImpl(device_.type())) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  try {
    // High priority for the streams whose copies the compute stream waits on (Python: priority=-1); the
    // all-reduce stream at normal priority, as in Python.
    copy_in_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
    all_gather_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
    reduce_scatter_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
    all_reduce_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  } catch (const c10::Error&) {
    return;  // a backend without a stream pool: everything on the current stream, as on the CPU
  }
  separate_ = true;
}

c10::Stream CommStreams::current() const {
  if (!c10::impl::hasDeviceGuardImpl(device_.type())) return c10::Stream(c10::Stream::DEFAULT, device_);
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

StreamEvent CommStreams::record(c10::Stream stream) {
  StreamEvent out;
  if (!separate_) return out;
  out.event_ = std::make_shared<c10::Event>(device_.type());
  out.event_->record(stream);
  ++events_recorded_;
  return out;
}

void CommStreams::wait(c10::Stream waiter, const StreamEvent& event) {
  ++waits_issued_;
  if (event.event_) event.event_->block(waiter);
}

void CommStreams::wait_stream(c10::Stream waiter, c10::Stream waited) {
  if (!separate_ || waiter == waited) return;
  wait(waiter, record(waited));
}

void CommStreams::synchronize(const StreamEvent& event) {
  if (event.event_) event.event_->synchronize();
}

void HeldBuffer::hold(at::Tensor buffer, StreamEvent event) {
  TORCH_CHECK(!buffer_.defined(), "fsdp internal: a held buffer was replaced before it was released");
  buffer_ = std::move(buffer);
  event_ = std::move(event);
}

void HeldBuffer::release(CommStreams& streams, const std::vector<c10::Stream>& waiters) {
  if (!buffer_.defined()) return;
  for (const c10::Stream& s : waiters) streams.wait(s, event_);
  event_ = StreamEvent();
  buffer_ = at::Tensor();
}

}  // namespace fsdp::detail
