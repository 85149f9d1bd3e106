#pragma once
// A backward run from inside a node of another backward (activation checkpointing runs its recomputed region's
// backward this way) is a separate graph task for the autograd engine, with its own id and its own final
// callbacks. Code that tracks "the backward in progress" by graph task id (FSDP's end-of-backward callback)
// must not mistake such a nested backward for a new one — nor for a sign that the earlier backward died.
// NestedBackwardScope marks the nesting for the thread that runs it (the engine runs a reentrant backward on
// the thread that started it, so its hooks see the mark); runs_within_backward asks.
//
// Per-thread state, not global: each thread's stack holds only the graph tasks that thread is nested in, and a
// scope removes its entry when the nested backward returns or throws.

#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <vector>

namespace fsdp::detail {

inline std::vector<int>& enclosing_backward_passes() {
  thread_local std::vector<int> passes;
  return passes;
}

// Held around a backward started from inside a node of the current one.
class NestedBackwardScope {
 public:
  NestedBackwardScope() { enclosing_backward_passes().push_back(torch::autograd::get_current_graph_task_id()); }
  NestedBackwardScope(const NestedBackwardScope&) = delete;
  NestedBackwardScope& operator=(const NestedBackwardScope&) = delete;
  ~NestedBackwardScope() { enclosing_backward_passes().pop_back(); }
};

// True when the current backward is graph task `pass` or runs nested inside it.
inline bool runs_within_backward(int pass) {
  if (pass == -1) return false;
  if (torch::autograd::get_current_graph_task_id() == pass) return true;
  const auto& enclosing = enclosing_backward_passes();
  return std::find(enclosing.begin(), enclosing.end(), pass) != enclosing.end();
}

}  // namespace fsdp::detail
