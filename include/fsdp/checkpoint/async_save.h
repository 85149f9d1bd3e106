#pragma once
// Asynchronous checkpoint saves with TorchTitan's async_mode semantics:
//
//   fsdp::checkpoint::AsyncSaver saver(fsdp::new_group(all_ranks, "checkpoint"), AsyncMode::Async);
//   ...
//   saver.save(sd, step_path(folder, step));   // stalls only for the snapshot; writes in the background
//   ...                                        // training goes on
//   saver.wait();                               // before exit (the final save is best made synchronous)
//
// - the state is snapshotted (deep-copied to CPU memory, pinned for device tensors with AsyncWithPinnedMem):
//   that copy is the only stall; the save then runs on a background thread;
// - at most one save is in flight: save() first waits for the previous one;
// - the error of a background save is never lost: it is raised by the next save(), wait() or check();
// - the background save's collectives use the saver's own group (create it with fsdp::new_group over the same
//   ranks), so they never interleave with the training's collectives on another group.
// With AsyncMode::Disabled, save() is synchronous and returns after the save completed.
//
// Staging::Background goes further (PyTorch DCP's async staging): the snapshot itself is taken on the
// background thread and save() returns at once; the caller must call wait_staged() before it next changes the
// tensors of the state (the optimizer step), so the stall is only what the snapshot has not finished by then.
// Values (JSON text) are copied before save() returns.

#include <fsdp/checkpoint/checkpoint.h>

#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace fsdp::checkpoint {

enum class AsyncMode { Disabled, Async, AsyncWithPinnedMem };
enum class Staging { Blocking, Background };
// TorchTitan's names: "disabled", "async", "async_with_pinned_mem" (error listing them otherwise).
AsyncMode parse_async_mode(const std::string& name);

// A deep CPU copy of every tensor of `state` (values copied too). `cast`: floating-point tensors are converted
// to it (e.g. an export dtype). pin_memory: device tensors are copied into pinned CPU memory (faster device to
// host copies on CUDA; nothing to pin for CPU tensors).
StateDict snapshot(const StateDict& state, std::optional<c10::ScalarType> cast = std::nullopt,
                   bool pin_memory = false);

struct AsyncSaverOptions {
  AsyncMode mode = AsyncMode::Async;
  Staging staging = Staging::Blocking;
  // Keep the snapshot's CPU buffers for the next save (TorchTitan keeps its pinned staging state dict the same
  // way): from the second save on, staging copies into memory that is already mapped, instead of paying a page
  // fault per 4 KiB. Costs one CPU copy of the state kept between saves; a key whose shape or dtype changed
  // gets a new buffer.
  bool reuse_staging_buffers = true;
  // Linux: the background write runs at the lowest CPU priority (nice 19, that thread only), so where the
  // training fills the cores the write takes their idle time, not step time. The save then takes longer; it
  // still completes (idle time appears at every collective wait), and the next save() waits for it.
  bool low_priority_write = true;
};

class AsyncSaver {
 public:
  // group: the process group the background saves use (null = a single process). Must not be used for
  // anything else while a save may be in flight.
  explicit AsyncSaver(ProcessGroupPtr group, AsyncMode mode = AsyncMode::Async, Staging staging = Staging::Blocking);
  AsyncSaver(ProcessGroupPtr group, const AsyncSaverOptions& options);
  ~AsyncSaver();  // waits for the save in flight; its error is printed to stderr (it can no longer be raised)
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  struct Started {
    double stage_seconds = 0;  // the stall: snapshot (async) or the whole save (disabled)
    bool background = false;   // the save runs in the background
  };
  // Raises a previous background save's error; waits for a save still in flight; snapshots `state`; starts the
  // save of the snapshot to `path` (options.group is replaced by the saver's group). `after`, when given, runs
  // after a successful save on the same thread (e.g. purging old checkpoints); its errors surface like the
  // save's. `cast` applies to the snapshot (see snapshot()).
  Started save(const StateDict& state, const std::string& path, SaveOptions options = {},
               std::function<void(const SaveResult&)> after = {}, std::optional<c10::ScalarType> cast = std::nullopt);
  // Background staging: blocks until the snapshot of the save in flight is complete (the state's tensors may
  // change afterwards). Returns the seconds it waited; a no-op otherwise.
  double wait_staged();
  // Waits for the save in flight (if any) and raises its error; returns its result.
  std::optional<SaveResult> wait();
  // Raises the error of a finished background save without waiting for one in flight.
  void check();
  bool in_flight() const;
  AsyncMode mode() const;
  // Bytes of CPU staging buffers this saver allocated so far (with reuse_staging_buffers, the state's size
  // after the first save, growing only when a tensor changes shape or dtype).
  int64_t staging_bytes_allocated() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::checkpoint
