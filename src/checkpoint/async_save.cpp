// Asynchronous checkpoint saves (see include/fsdp/checkpoint/async_save.h). One background thread per save;
// the save's outcome (result or exception) is kept until the owner asks for it, so no error is ever dropped.
#include <fsdp/checkpoint/async_save.h>
#include <fsdp/util/timer.h>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <future>
#include <iostream>
#include <thread>
#include <type_traits>
#include <unordered_map>

#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fsdp::checkpoint {
namespace {
using Clock = util::SteadyClock;
}  // namespace

AsyncMode parse_async_mode(const std::string& name) {
  if (name == "disabled") return AsyncMode::Disabled;
  if (name == "async") return AsyncMode::Async;
  if (name == "async_with_pinned_mem") return AsyncMode::AsyncWithPinnedMem;
  TORCH_CHECK(false, "checkpoint async_mode '", name, "' is not one of disabled, async, async_with_pinned_mem");
}

namespace {
// Device-to-host staging (what async_with_pinned_mem is for on CUDA). A device's tensors are copied on a side
// stream of that device, ordered after an event recorded on the caller's current stream when it asked for
// the save: the copies see the state as of save(), and with background staging they run on the copy engine
// beside the training's kernels rather than queued between them on the training's stream. The snapshot is
// complete only once those side streams are synchronised. Devices without streams (CPU, meta) copy as before.
class DeviceStaging {
 public:
  // On the caller's thread, when the save is asked for.
  explicit DeviceStaging(const StateDict& state) {
    for (const auto& [k, t] : state.tensors) note(t.local());
    for (const auto& [k, t] : state.full) note(t);
  }
  // On the staging thread: the stream to copy `t` on; nullopt = the current one (no device stream for it).
  std::optional<c10::Stream> stream_for(const at::Tensor& t) {
    auto it = devices_.find(t.device());
    if (it == devices_.end()) return std::nullopt;
    Side& side = it->second;
    if (!side.stream) {
      side.stream = c10::impl::VirtualGuardImpl(t.device().type()).getStreamFromGlobalPool(t.device());
      side.ready->block(*side.stream);
    }
    return side.stream;
  }
  // The copies issued on the side streams are complete (their pinned destinations may be read).
  void synchronize() {
    for (auto& [device, side] : devices_) {
      if (side.stream) side.stream->synchronize();
    }
  }

 private:
  struct Side {
    std::shared_ptr<c10::Event> ready;  // recorded on the caller's stream at save()
    std::optional<c10::Stream> stream;  // taken from the device's pool at the first copy
  };
  void note(const at::Tensor& t) {
    if (!t.defined() || t.is_cpu() || t.is_meta()) return;
    const c10::Device device = t.device();
    if (devices_.count(device) || !c10::impl::hasDeviceGuardImpl(device.type())) return;
    c10::impl::VirtualGuardImpl impl(device.type());
    Side side;
    side.ready = std::make_shared<c10::Event>(device.type());
    try {
      side.ready->record(impl.getStream(device));
    } catch (const c10::Error&) {
      return;  // a backend without events: copy on the current stream (ordered by that stream alone)
    }
    devices_.emplace(device, std::move(side));
  }
  std::unordered_map<c10::Device, Side> devices_;
};

// snapshot() into the buffers of an earlier snapshot where a key's buffer still fits (same sizes, strides,
// dtype and pinnedness), new ones elsewhere. `reuse` is consumed. `staging`: from the caller's thread at
// save() (see DeviceStaging); default = captured here.
StateDict snapshot_into(const StateDict& state, StateDict reuse, std::optional<c10::ScalarType> cast,
                        bool pin_memory, std::atomic<int64_t>* allocated_bytes = nullptr,
                        std::optional<DeviceStaging> staging = std::nullopt) {
  if (!staging) staging.emplace(state);
  auto copy = [&](const at::Tensor& t, at::Tensor old) {
    at::Tensor src = t.detach();
    const auto dtype = cast && at::isFloatingType(src.scalar_type()) ? *cast : src.scalar_type();
    const bool pin = pin_memory && !src.is_cpu();
    const bool fits = old.defined() && old.sizes() == src.sizes() && old.strides() == src.strides() &&
                      old.scalar_type() == dtype && old.is_pinned() == pin;
    at::Tensor out = fits ? std::move(old)
                          : at::empty_strided(src.sizes(), src.strides(),
                                              src.options().dtype(dtype).device(at::kCPU).pinned_memory(pin));
    if (!fits && allocated_bytes) *allocated_bytes += static_cast<int64_t>(out.storage().nbytes());
    if (const auto side = staging->stream_for(src)) {
      c10::StreamGuard on_side(*side);
      out.copy_(src, /*non_blocking=*/out.is_pinned());  // converts the dtype too; complete at synchronize()
    } else {
      out.copy_(src);
    }
    return out;
  };
  auto take = [](auto& map, const std::string& key) {
    auto it = map.find(key);
    if (it == map.end()) return at::Tensor();
    at::Tensor t;
    if constexpr (std::is_same_v<std::decay_t<decltype(it->second)>, at::Tensor>) t = std::move(it->second);
    else t = it->second.local();
    map.erase(it);
    return t;
  };
  StateDict out;
  for (const auto& [k, t] : state.tensors) {
    out.tensors.emplace(k, ShardedTensor::from_local(copy(t.local(), take(reuse.tensors, k)), t.mesh(),
                                                     t.placements(), t.sizes()));
  }
  for (const auto& [k, t] : state.full) out.full.emplace(k, copy(t, take(reuse.full, k)));
  staging->synchronize();
  out.values = state.values;
  return out;
}
}  // namespace

StateDict snapshot(const StateDict& state, std::optional<c10::ScalarType> cast, bool pin_memory) {
  return snapshot_into(state, StateDict{}, cast, pin_memory);
}

struct AsyncSaver::Impl {
  ProcessGroupPtr group;
  AsyncSaverOptions options;
  StateDict staging_buffers;  // the last snapshot, once its save is over (reuse_staging_buffers)
  std::atomic<int64_t> staging_bytes_allocated{0};
  std::thread worker;
  std::shared_future<void> staged;   // background staging: ready when the snapshot is complete
  std::atomic<bool> done{true};
  std::optional<SaveResult> result;  // of the last save, until wait() hands it out
  std::exception_ptr error;          // of the last save, until raised

  void join() {
    if (worker.joinable()) worker.join();
    staged = {};
  }
  // The background part of a save: write, then the owner's continuation; the outcome is kept for the owner.
  // On the worker thread, after the snapshot: write it, then keep its buffers for the next snapshot.
  void run(StateDict snap, const std::string& path, const SaveOptions& save_options,
           const std::function<void(const SaveResult&)>& after) {
#ifdef __linux__
    if (options.low_priority_write) ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
#endif
    try {
      SaveResult r = checkpoint::save(snap, path, save_options);
      if (after) after(r);
      result = r;
    } catch (...) {
      error = std::current_exception();
    }
    if (options.reuse_staging_buffers) staging_buffers = std::move(snap);
    done = true;
  }
  // Before a snapshot (no save in flight): the buffers to copy into.
  StateDict take_staging_buffers() { return options.reuse_staging_buffers ? std::move(staging_buffers) : StateDict{}; }
  void raise_error() {
    if (error) {
      auto e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
  }
};

AsyncSaver::AsyncSaver(ProcessGroupPtr group, AsyncMode mode, Staging staging)
    : AsyncSaver(std::move(group), [&] {
        AsyncSaverOptions o;
        o.mode = mode;
        o.staging = staging;
        return o;
      }()) {}

AsyncSaver::AsyncSaver(ProcessGroupPtr group, const AsyncSaverOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->group = std::move(group);
  impl_->options = options;
}

AsyncSaver::~AsyncSaver() {
  impl_->join();
  if (impl_->error) {
    try {
      std::rethrow_exception(impl_->error);
    } catch (const std::exception& e) {
      std::cerr << "checkpoint: a background save failed and was never waited for: " << e.what() << std::endl;
    }
  }
}

AsyncSaver::Started AsyncSaver::save(const StateDict& state, const std::string& path, SaveOptions options,
                                     std::function<void(const SaveResult&)> after,
                                     std::optional<c10::ScalarType> cast) {
  wait();  // at most one in flight; raises the previous one's error
  options.group = impl_->group;
  if (!impl_->group) options.local_only = true;
  const auto t0 = Clock::now();
  Started started;
  if (impl_->options.mode == AsyncMode::Disabled) {
    SaveResult r = cast ? checkpoint::save(snapshot(state, cast), path, options) : checkpoint::save(state, path, options);
    if (after) after(r);
    impl_->result = r;
    started.stage_seconds = util::seconds_since(t0);
    return started;
  }
  const bool pin = impl_->options.mode == AsyncMode::AsyncWithPinnedMem;
  started.background = true;
  impl_->done = false;
  if (impl_->options.staging == Staging::Blocking) {
    auto snap = std::make_shared<StateDict>(snapshot_into(state, impl_->take_staging_buffers(), cast, pin,
                                                                &impl_->staging_bytes_allocated));
    started.stage_seconds = util::seconds_since(t0);
    impl_->staged = {};
    impl_->worker = std::thread([impl = impl_.get(), snap, path, options, after = std::move(after)] {
      impl->run(std::move(*snap), path, options, after);
    });
    return started;
  }
  // Background staging: the thread reads the live tensors (concurrent reads are safe) until the snapshot is
  // complete; the owner promised not to change them before wait_staged().
  auto live = std::make_shared<StateDict>(state);  // shares the tensors; copies the values now
  DeviceStaging device_staging(state);              // the state as of now, on the device's streams
  std::promise<void> staged;
  impl_->staged = staged.get_future().share();
  impl_->worker = std::thread([impl = impl_.get(), live, reuse = impl_->take_staging_buffers(),
                               staged = std::move(staged), path, options, cast, pin, after = std::move(after),
                               device_staging = std::move(device_staging)]() mutable {
    StateDict snap;
    try {
      snap = snapshot_into(*live, std::move(reuse), cast, pin, &impl->staging_bytes_allocated,
                           std::move(device_staging));
    } catch (...) {
      impl->error = std::current_exception();
    }
    live.reset();
    staged.set_value();
    if (!impl->error) impl->run(std::move(snap), path, options, after);
    impl->done = true;
  });
  started.stage_seconds = util::seconds_since(t0);
  return started;
}

double AsyncSaver::wait_staged() {
  if (!impl_->staged.valid()) return 0;
  const auto t0 = Clock::now();
  impl_->staged.wait();
  impl_->staged = {};
  return util::seconds_since(t0);
}

std::optional<SaveResult> AsyncSaver::wait() {
  impl_->join();
  impl_->raise_error();
  auto r = std::move(impl_->result);
  impl_->result.reset();
  return r;
}

void AsyncSaver::check() {
  if (!impl_->done) return;  // still running: its error surfaces at a later call
  impl_->join();
  impl_->raise_error();
}

bool AsyncSaver::in_flight() const { return !impl_->done; }
int64_t AsyncSaver::staging_bytes_allocated() const { return impl_->staging_bytes_allocated; }
AsyncMode AsyncSaver::mode() const { return impl_->options.mode; }

}  // namespace fsdp::checkpoint
