#pragma once
// A background thread that drives the local part of collectives (e.g. the reduce-scatter's reduction of
// chunks as they arrive) so it proceeds while the training thread computes. Gloo's transport thread moves the
// bytes; this thread waits for them and does the arithmetic. One per process group, started on first use;
// the thread takes tasks in submission order (the order the group issued its collectives); a task may instead
// run on the thread that waits for it (TaskState).
//
// Private to src/comm.

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fsdp::comm {

// One task and its completion. Whoever claims it first runs it: the progress thread, or a caller of wait()
// that finds it not yet started — then the waiting thread, idle anyway, does the work itself instead of
// paying a hand-off to another thread (which costs scheduling delays on a loaded machine).
class TaskState {
 public:
  explicit TaskState(std::function<void()> fn) : fn_(std::move(fn)) {}
  // Runs the task if nobody claimed it yet; records its exception.
  void run_if_unclaimed();
  bool done() const;
  // Runs the task here if unclaimed, else blocks until it ran or `timeout` passed (false). Rethrows the
  // task's exception.
  bool wait(std::chrono::milliseconds timeout);
  // Blocks until the task ran (on whichever thread claims it) or `timeout` passed (false), without claiming it:
  // for a thread that only watches. Rethrows the task's exception.
  bool wait_done(std::chrono::milliseconds timeout);

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool claimed_ = false;
  bool done_ = false;
  std::function<void()> fn_;
  std::exception_ptr error_;
};

class ProgressThread {
 public:
  explicit ProgressThread(std::string name);
  // Runs every task already submitted, then joins: a task may still be writing into tensors it holds.
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  std::shared_ptr<TaskState> submit(std::function<void()> task);

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<TaskState>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: started after every other member exists
};

}  // namespace fsdp::comm
