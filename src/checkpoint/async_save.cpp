// Asynchronous checkpoint saves (see include/fsdp/checkpoint/async_save.h). One background thread per save;
// the save's outcome (result or exception) is kept until the owner asks for it, so no error is ever dropped.
#include <fsdp/checkpoint/async_save.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <future>
#include <iostream>
#include <thread>

namespace fsdp::checkpoint {
namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

AsyncMode parse_async_mode(const std::string& name) {
  if (name == "disabled") return AsyncMode::Disabled;
  if (name == "async") return AsyncMode::Async;
  if (name == "async_with_pinned_mem") return AsyncMode::AsyncWithPinnedMem;
  TORCH_CHECK(false, "checkpoint async_mode '", name, "' is not one of disabled, async, async_with_pinned_mem");
}

StateDict snapshot(const StateDict& state, std::optional<c10::ScalarType> cast, bool pin_memory) {
  auto copy = [&](const at::Tensor& t) {
    at::Tensor src = t.detach();
    if (cast && at::isFloatingType(src.scalar_type())) src = src.to(*cast);  // converts on the source device
    at::Tensor out = at::empty_strided(src.sizes(), src.strides(),
                                       src.options().device(at::kCPU).pinned_memory(pin_memory && !src.is_cpu()));
    out.copy_(src);
    return out;
  };
  StateDict out;
  for (const auto& [k, t] : state.tensors)
    out.tensors.emplace(k, ShardedTensor::from_local(copy(t.local()), t.mesh(), t.placements(), t.sizes()));
  for (const auto& [k, t] : state.full) out.full.emplace(k, copy(t));
  out.values = state.values;
  return out;
}

struct AsyncSaver::Impl {
  ProcessGroupPtr group;
  AsyncMode mode = AsyncMode::Async;
  Staging staging = Staging::Blocking;
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
  void run(const StateDict& snap, const std::string& path, const SaveOptions& options,
           const std::function<void(const SaveResult&)>& after) {
    try {
      SaveResult r = checkpoint::save(snap, path, options);
      if (after) after(r);
      result = r;
    } catch (...) {
      error = std::current_exception();
    }
    done = true;
  }
  void raise_error() {
    if (error) {
      auto e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
  }
};

AsyncSaver::AsyncSaver(ProcessGroupPtr group, AsyncMode mode, Staging staging) : impl_(std::make_unique<Impl>()) {
  impl_->group = std::move(group);
  impl_->mode = mode;
  impl_->staging = staging;
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
  if (impl_->mode == AsyncMode::Disabled) {
    SaveResult r = cast ? checkpoint::save(snapshot(state, cast), path, options) : checkpoint::save(state, path, options);
    if (after) after(r);
    impl_->result = r;
    started.stage_seconds = since(t0);
    return started;
  }
  const bool pin = impl_->mode == AsyncMode::AsyncWithPinnedMem;
  started.background = true;
  impl_->done = false;
  if (impl_->staging == Staging::Blocking) {
    auto snap = std::make_shared<StateDict>(snapshot(state, cast, pin));
    started.stage_seconds = since(t0);
    impl_->staged = {};
    impl_->worker = std::thread([impl = impl_.get(), snap, path, options, after = std::move(after)] {
      impl->run(*snap, path, options, after);
    });
    return started;
  }
  // Background staging: the thread reads the live tensors (concurrent reads are safe) until the snapshot is
  // complete; the owner promised not to change them before wait_staged().
  auto live = std::make_shared<StateDict>(state);  // shares the tensors; copies the values now
  std::promise<void> staged;
  impl_->staged = staged.get_future().share();
  impl_->worker = std::thread([impl = impl_.get(), live, staged = std::move(staged), path, options, cast, pin,
                               after = std::move(after)]() mutable {
    StateDict snap;
    try {
      snap = snapshot(*live, cast, pin);
    } catch (...) {
      impl->error = std::current_exception();
    }
    live.reset();
    staged.set_value();
    if (!impl->error) impl->run(snap, path, options, after);
    impl->done = true;
  });
  started.stage_seconds = since(t0);
  return started;
}

double AsyncSaver::wait_staged() {
  if (!impl_->staged.valid()) return 0;
  const auto t0 = Clock::now();
  impl_->staged.wait();
  impl_->staged = {};
  return since(t0);
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
AsyncMode AsyncSaver::mode() const { return impl_->mode; }

}  // namespace fsdp::checkpoint
