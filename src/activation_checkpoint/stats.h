#pragma once
// The counters behind fsdp::checkpoint_stats(root): one set per checkpointed module, kept with the module's
// forward wrapper (nn::forward_wrapper_state), so two models in one process never share them. Atomics: backward
// may run on the engine's device threads.

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
}  // namespace fsdp::detail
