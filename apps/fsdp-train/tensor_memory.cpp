// The counting CPU allocator of tensor_memory.h.
#include "tensor_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <unordered_map>
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

// Each counted storage: its size and how the base allocator frees it. Keyed by the data pointer, which is also
// the DataPtr's context: libtorch's raw_allocate (used e.g. by bfloat16 kernels' scratch buffers) requires
// context == data, so the size cannot travel in a context object of its own.
struct Block {
  int64_t bytes = 0;
  c10::DeleterFnPtr base_deleter = nullptr;
  void* base_context = nullptr;
};
std::mutex g_blocks_mutex;
std::unordered_map<void*, Block> g_blocks;

void delete_counted(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(g_blocks_mutex);
    const auto it = g_blocks.find(data);
    if (it == g_blocks.end()) return;  // never counted (cannot happen: only this allocator hands this deleter out)
    block = it->second;
    g_blocks.erase(it);
  }
  record(g_live.fetch_sub(block.bytes, std::memory_order_relaxed) - block.bytes);
  if (block.base_deleter) block.base_deleter(block.base_context);  // frees through the base allocator
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr base = base_->allocate(n);
    void* data = base.get();
    if (data == nullptr) return base;  // empty storage: nothing to count
    const c10::Device device = base.device();
    Block block{static_cast<int64_t>(n), base.get_deleter(), nullptr};
    block.base_context = base.release_context();
    {
      std::lock_guard<std::mutex> lock(g_blocks_mutex);
      g_blocks[data] = block;
    }
    add(block.bytes);
    return {data, data, &delete_counted, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_counted; }
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
