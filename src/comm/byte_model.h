#pragma once
// Bytes this rank puts on the wire for each collective, per the algorithm the layer runs (or, where Gloo picks
// the algorithm, the ring/flat model it matches). `bytes` is the size of the tensor named in each formula,
// `s` the group size. Size-1 groups and empty tensors send nothing. See docs/comm.md.

#include <cstdint>

namespace fsdp::comm {

// Ring all-gather: every rank's chunk travels s-1 hops; this rank forwards s-1 chunks of `input_bytes`.
inline int64_t all_gather_bytes(int64_t input_bytes, int64_t s) { return (s - 1) * input_bytes; }

// Our reduce-scatter is an all-to-all of the s chunks of the input: s-1 chunks leave this rank. That is
// (s-1)/s of the input, the same as the ring reduce-scatter optimum.
inline int64_t reduce_scatter_bytes(int64_t input_bytes, int64_t s) { return (s - 1) * input_bytes / s; }

// Ring all-reduce = reduce-scatter + all-gather of 1/s-sized chunks: 2(s-1)/s of the tensor.
inline int64_t all_reduce_bytes(int64_t tensor_bytes, int64_t s) { return 2 * (s - 1) * tensor_bytes / s; }

// Broadcast, flat model: the root sends the tensor to each of the s-1 others; the others send nothing.
inline int64_t broadcast_bytes(int64_t tensor_bytes, int64_t s, bool is_root) {
  return is_root ? (s - 1) * tensor_bytes : 0;
}

// All-to-all with equal splits: s-1 of the s chunks of the input leave this rank.
inline int64_t all_to_all_bytes(int64_t input_bytes, int64_t s) { return (s - 1) * input_bytes / s; }

}  // namespace fsdp::comm
