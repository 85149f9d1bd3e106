#pragma once
// The process-wide counters behind fsdp::checkpoint_stats() (backward may run on the engine's device threads,
// hence atomics).

#include <atomic>
#include <cstdint>

namespace fsdp::detail {
struct CheckpointCounters {
  std::atomic<int64_t> forwards{0};
  std::atomic<int64_t> recomputes{0};
  std::atomic<int64_t> mm_saved{0};
  std::atomic<int64_t> mm_reused{0};
  std::atomic<int64_t> mm_recomputed{0};
};
CheckpointCounters& checkpoint_counters();
}  // namespace fsdp::detail
