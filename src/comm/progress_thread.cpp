#include "comm/progress_thread.h"

#include <pthread.h>

namespace fsdp::comm {

void TaskState::run_if_unclaimed() {
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (claimed_) return;
    claimed_ = true;
    fn = std::move(fn_);
  }
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  fn = nullptr;  // release captured tensors before reporting completion
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

bool TaskState::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

bool TaskState::wait(std::chrono::milliseconds timeout) {
  run_if_unclaimed();
  return wait_done(timeout);
}

bool TaskState::wait_done(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) return false;
  if (error_) std::rethrow_exception(error_);
  return true;
}

ProgressThread::ProgressThread(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

ProgressThread::~ProgressThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<TaskState> ProgressThread::submit(std::function<void()> task) {
  auto state = std::make_shared<TaskState>(std::move(task));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(state);
  }
  cv_.notify_one();
  return state;
}

void ProgressThread::run() {
  // Visible in top/gdb as the group's progress thread (15 characters at most).
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  for (;;) {
    std::shared_ptr<TaskState> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task->run_if_unclaimed();
  }
}

}  // namespace fsdp::comm
