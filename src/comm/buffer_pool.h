#pragma once
// A few reusable scratch tensors per process group (the reduce-scatter's receive slots and fp32 accumulator).
// Large allocations come from mmap: a fresh buffer per collective pays page faults and kernel zeroing on every
// call, which on this machine costs as much as moving the bytes. Thread-safe: buffers are taken on the issuing
// thread and given back by whichever thread finished the collective. Private to src/comm.

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace fsdp::comm {

class BufferPool {
 public:
  // A contiguous 1-D tensor of exactly `numel` elements: a pooled one when available, else a new one.
  at::Tensor take(int64_t numel, const at::TensorOptions& options) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->numel() == numel && it->options().dtype() == options.dtype() && it->device() == options.device()) {
          at::Tensor t = std::move(*it);
          free_.erase(it);
          return t;
        }
      }
    }
    return at::empty({numel}, options);
  }
  // Only when nothing (no pending receive) can still write into `t`.
  void give_back(at::Tensor t) {
    if (!t.defined()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() >= kMaxBuffers) free_.erase(free_.begin());  // keep the most recent sizes
    free_.push_back(std::move(t));
  }

 private:
  static constexpr size_t kMaxBuffers = 4;
  std::mutex mutex_;
  std::vector<at::Tensor> free_;
};

}  // namespace fsdp::comm
