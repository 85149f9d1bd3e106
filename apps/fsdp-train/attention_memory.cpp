// One block's attention memory per rank (attention_memory.h).
#include "attention_memory.h"

#include <algorithm>

namespace fsdp_train {

AttentionMemory attention_memory(const AttentionShape& s, int64_t tokens, int64_t element_bytes, int64_t cp,
                                 bool all_gather) {
  AttentionMemory m;
  const int64_t q = tokens * s.heads * s.qk_head_dim, kv = tokens * s.heads * (s.qk_head_dim + s.v_head_dim);
  const int64_t out = tokens * s.heads * s.v_head_dim;
  m.saved = (q + kv + out) * element_bytes + tokens * s.heads * 4;
  if (cp <= 1) return m;
  const int64_t others = all_gather ? cp : std::min<int64_t>(2, cp - 1);
  m.forward_in_flight = others * kv * element_bytes;
  m.backward_in_flight = m.forward_in_flight + q * 4 + (all_gather ? (cp + 1) * kv * 4 : 2 * kv * 4);
  return m;
}

}  // namespace fsdp_train
