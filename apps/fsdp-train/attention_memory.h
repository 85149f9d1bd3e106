#pragma once
// The attention memory of one transformer block on one rank, for fsdp-train's start-up log line and fsdp-plan's
// report (one formula for both; docs/planner.md, "Context parallelism"). What the attention saves for backward
// (q, k, v as the kernel sees them, its output, the float32 log-sum-exp per head) at the tokens the rank holds,
// and, under context parallelism, what a ring-attention call (src/context_parallel) holds beyond that while it
// runs: the other ranks' K and V (all-gather: every rank's, cp x this rank's, its own copy included; the ring: at
// most two other ranks' at a time), and in backward also the float32 dQ and dK / dV accumulators (all-gather:
// every rank's plus the reduce-scatter output; the ring: the one computed on and the one in flight).
#include <cstdint>

namespace fsdp_train {

struct AttentionShape {
  int64_t heads = 0;        // query heads of this rank (K / V repeated to them under GQA), 0 = unknown
  int64_t qk_head_dim = 0;  // per head, of q and k
  int64_t v_head_dim = 0;   // per head, of v and the output
};

struct AttentionMemory {
  int64_t saved = 0;               // bytes one block's attention keeps for backward
  int64_t forward_in_flight = 0;   // bytes beyond `saved` during a forward call (cp > 1)
  int64_t backward_in_flight = 0;  // bytes beyond `saved` during a backward call (cp > 1)
};

// `tokens`: the tokens of the rank's batch it attends for (local batch x seq / cp); `element_bytes`: the compute
// dtype's; `all_gather`: context_parallel_rotate_method = allgather (else the ring).
AttentionMemory attention_memory(const AttentionShape& shape, int64_t tokens, int64_t element_bytes, int64_t cp,
                                 bool all_gather);

}  // namespace fsdp_train
