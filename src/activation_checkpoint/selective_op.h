#pragma once
// Op-level selective activation checkpointing (TorchTitan's "op" SAC policy) without TorchDispatchMode, which
// libtorch's C++ API lacks. While a SelectiveOpScope is alive, the dispatch key `Fake` is added to this
// thread's included keys; libfsdp registers a fallthrough for every operator on that key (so other operators do
// not notice) and a boxed kernel for aten::mm, aten::addmm and aten::bmm. The key sits *below* autograd, so the
// kernel sees each matmul after autograd recorded it:
//  * Record (the checkpointed forward): every matmul is counted; the 1st, 3rd, 5th, ... outputs are kept.
//  * Replay (the recomputation in backward): the same count; a kept output is handed back instead of computing
//    it (autograd still records the matmul's backward, which needs only its inputs); the others run normally.
// aten::linear decomposes into addmm/mm (or matmul -> mm/bmm) above autograd, so it is counted once.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// The matmul outputs one checkpointed call kept at forward.
struct CheckpointCounters;

struct MatmulStash {
  struct Entry {
    std::string op;
    at::Tensor value;  // a copy of the forward's output
  };
  std::vector<Entry> kept;
  int64_t total = 0;  // matmuls counted at forward
  std::shared_ptr<CheckpointCounters> counters;  // the checkpointed module's (mm_saved / mm_reused / mm_recomputed)
};

enum class SelectiveOpMode { Record, Replay };

class SelectiveOpScope {
 public:
  // stash == nullptr: a nested region without op SAC; it hides its matmuls from an enclosing op-SAC region
  // (which counts the nested region's forward as one unit, in forward and recomputation alike).
  SelectiveOpScope(MatmulStash* stash, SelectiveOpMode mode);
  ~SelectiveOpScope();
  // After a Replay: every matmul of the forward was seen again (else the recomputation diverged).
  void check_complete() const;
  SelectiveOpScope(const SelectiveOpScope&) = delete;
  SelectiveOpScope& operator=(const SelectiveOpScope&) = delete;

  struct Context {
    MatmulStash* stash;
    SelectiveOpMode mode;
    int64_t count = 0;
    size_t next_kept = 0;
  };

 private:
  Context context_;
  Context* previous_;
  bool included_;  // this scope added the key to the thread's included set
};

// Registers the kernels (once, at the first op-SAC checkpoint; fails if something else owns the key).
void ensure_selective_op_kernels();

}  // namespace fsdp::detail
