// Planning layer (see planning.h).
#include "checkpoint/planning.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::checkpoint::detail {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

WritePlan plan_write(const std::string& fqn, const ShardedTensor& t) {
  TORCH_CHECK(t.defined(), "checkpoint: '", fqn, "' is an undefined tensor");
  WritePlan plan;
  plan.box.offsets = t.local_offset();
  plan.box.sizes = t.local().sizes().vec();
  const auto coord = t.mesh().coordinate();
  bool first_replica = true;
  for (size_t d = 0; d < t.placements().size(); ++d) {
    const Placement& p = t.placements()[d];
    TORCH_CHECK(!p.is_partial(), "checkpoint: '", fqn, "' has a Partial placement on mesh dim ", d,
                ": redistribute it to Replicate or Shard before saving");
    if (p.is_replicate() && coord[d] != 0) first_replica = false;
  }
  plan.write = first_replica && t.local().numel() > 0;
  return plan;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets.push_back(lo);
    out.sizes.push_back(hi - lo);
  }
  return out;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size(), 1);
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * std::max<int64_t>(sizes[i + 1], 1);
  return st;
}

std::pair<int64_t, int64_t> element_span(const Box& outer, const Box& sub) {
  const auto st = contiguous_strides(outer.sizes);
  int64_t first = 0, last = 0;
  for (size_t d = 0; d < st.size(); ++d) {
    first += (sub.offsets[d] - outer.offsets[d]) * st[d];
    last += (sub.offsets[d] + sub.sizes[d] - 1 - outer.offsets[d]) * st[d];
  }
  return {first, last};
}

}  // namespace fsdp::checkpoint::detail
