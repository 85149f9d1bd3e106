// The counting CPU allocator of tensor_memory.h.
#include "tensor_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

namespace fsdp_train::tensor_memory {
namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

// The timeline (start_timeline): checked without the lock on every allocation, appended under it.
std::atomic<bool> g_recording{false};
std::mutex g_timeline_mutex;
std::vector<Sample> g_timeline;

int64_t unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void record(int64_t live) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  if (g_recording.load(std::memory_order_relaxed)) g_timeline.push_back({unix_ns(), live});
}

void add(int64_t n) {
  const int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  record(now);
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// The wrapped allocation: the base allocator's DataPtr (its deleter runs when this is destroyed) and its size.
struct Counted {
  c10::DataPtr base;
  int64_t bytes;
};

void delete_counted(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  record(g_live.fetch_sub(c->bytes, std::memory_order_relaxed) - c->bytes);
  delete c;  // frees the storage through the base allocator's deleter
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr base = base_->allocate(n);
    void* data = base.get();
    const c10::Device device = base.device();
    auto* ctx = new Counted{std::move(base), static_cast<int64_t>(n)};
    add(ctx->bytes);
    return {data, ctx, &delete_counted, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* base_;
};

}  // namespace

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never deleted: storages allocated through it may outlive every other static.
    auto* alloc = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool installed() { return g_installed.load(); }
int64_t live_bytes() { return g_live.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() { g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed); }

void start_timeline() {
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  g_timeline.clear();
  g_timeline.push_back({unix_ns(), live_bytes()});
  g_recording = true;
}

std::vector<Sample> stop_timeline() {
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  g_recording = false;
  g_timeline.push_back({unix_ns(), live_bytes()});
  return std::move(g_timeline);
}

}  // namespace fsdp_train::tensor_memory
