#pragma once
// Planning layer of distributed checkpoints: which piece each rank writes (replicas deduplicated), and for a
// load, which saved chunks overlap each local piece and which contiguous byte span of a saved chunk holds an
// overlap. Pure functions: no I/O, no collectives.

#include <fsdp/sharded_tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace fsdp::checkpoint::detail {

struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
};

// The box of this rank's piece of `t` in global coordinates, and whether this rank is the one that writes it:
// the piece is non-empty and the rank sits at coordinate 0 of every mesh dim with a Replicate placement.
// Partial placements cannot be saved (error naming `fqn`).
struct WritePlan {
  Box box;
  bool write = false;
};
WritePlan plan_write(const std::string& fqn, const ShardedTensor& t);

// Intersection of two boxes of the same rank; nullopt when empty.
std::optional<Box> intersect(const Box& a, const Box& b);

// Row-major element range [first, last] (inclusive) that `sub` spans inside `outer` (sub inside outer),
// relative to outer's first element. The bytes a reader fetches for one overlap.
std::pair<int64_t, int64_t> element_span(const Box& outer, const Box& sub);

// Row-major strides of a box's elements.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);

}  // namespace fsdp::checkpoint::detail
