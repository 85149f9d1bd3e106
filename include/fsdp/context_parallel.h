#pragma once
// Context parallelism: one sequence split over the ranks of a `cp` group, each rank holding its chunks of the
// queries, keys and values, and causal attention computed by ring attention (PyTorch's
// torch.distributed.tensor.experimental.context_parallel, as TorchTitan applies it; docs/context_parallel.md).
//
//   auto q_local = ...;  // [batch, heads, seq/cp, head_dim]: this rank's chunks, in the layout below
//   at::Tensor out = fsdp::ring_attention(q_local, k_local, v_local, mesh.group("cp"), {});
//
// Layout ("load balancer"). HeadTail (TorchTitan's default): the sequence is cut into 2*cp equal chunks and cp
// rank i holds chunks i and 2*cp-1-i, in that order, so every rank does the same causal work. None: cp equal
// contiguous chunks, rank i holding chunk i. context_parallel_shard cuts a global [batch, seq, ...] tensor
// (tokens, labels, position ids) into a rank's chunks; positions stay global (context_parallel_positions).
//
// ring_attention is causal attention over the whole (global) sequence: each rank's queries attend to every key
// at an earlier or equal global position. Per pair of a query chunk and a key/value chunk: chunks wholly in the
// past are attended fully, the diagonal chunk causally, future chunks are skipped; the partial outputs merge
// through their log-sum-exp. Keys and values reach every rank by the rotate method:
//   AllGather: one all-gather of K and V per call (each rank then holds the full K and V for the duration);
//              backward gathers again and returns dK, dV to their owners by a reduce-scatter.
//   AllToAll:  a ring (send to cp rank+1, receive from rank-1, one chunk set per step, the next transfer in
//              flight while the current chunk computes): no rank ever holds more than two K/V chunk sets.
//              Backward passes K/V the same way and the dK/dV accumulators travel with them back to their owners.
// Backward recomputes each chunk pair from the saved global output and log-sum-exp (flash-attention backward on
// CPU; an exact chunked math kernel on other devices). Queries and keys have the same shape (repeat grouped KV
// heads first); values the same but for their head dim, which may differ (DeepSeek-V3's MLA: the output then has
// v's head dim; the narrower side travels padded with zeros). Every cp rank calls it with the same shapes, in the
// same order.

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace fsdp {

enum class CpRotateMethod { AllGather, AllToAll };
enum class CpLoadBalancer { None, HeadTail };

// TorchTitan's names: "allgather" | "alltoall"; "headtail" | "none". Anything else is one clear error.
CpRotateMethod parse_cp_rotate_method(std::string_view name);
CpLoadBalancer parse_cp_load_balancer(std::string_view name);
const char* to_string(CpRotateMethod method);
const char* to_string(CpLoadBalancer balancer);

struct ContextParallelOptions {
  CpRotateMethod rotate_method = CpRotateMethod::AllGather;
  CpLoadBalancer load_balancer = CpLoadBalancer::HeadTail;
};

// Causal attention of this rank's queries over the global sequence (see above). q, k: [batch, heads, seq_local,
// head_dim], v: [batch, heads, seq_local, v_head_dim], one dtype and device; seq_local divisible by the chunks per
// rank (2 with HeadTail). scale defaults to 1/sqrt(head_dim) (q's). Returns [batch, heads, seq_local,
// v_head_dim]. Differentiable in q, k and v.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProcessGroupPtr& cp_group,
                          const ContextParallelOptions& options = {}, std::optional<double> scale = std::nullopt);

// Document masking (block_causal) under context parallelism: each query attends only to keys of its own document
// at an earlier or equal global position, documents crossing chunk and rank boundaries. `document_ids` are this
// rank's chunks of the global ids ([batch, seq_local], int64: ids computed on whole rows, then cut like the
// tokens).
//
// The masked ring: context_parallel_gather_document_ids all-gathers the ids once per forward ([cp, batch,
// seq_local], tiny; collective), and block_causal_ring_attention is ring_attention under them: per pair of a
// query chunk and a key/value chunk the mask is causal-within-document on the two chunks' global positions;
// pairs where no query sees a key are skipped, pairs inside one document take the unmasked kernel, and a query
// row that sees no key of a chunk merges as nothing (log-sum-exp -inf). K and V travel by the rotate method,
// exactly as ring_attention's (AllToAll: the ring, never more than two foreign K/V chunk sets per rank).
// Differentiable in q, k and v.
at::Tensor context_parallel_gather_document_ids(const at::Tensor& document_ids, const ProcessGroupPtr& cp_group);
at::Tensor block_causal_ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& all_document_ids, const ProcessGroupPtr& cp_group,
                                       const ContextParallelOptions& options = {},
                                       std::optional<double> scale = std::nullopt);

// The same attention over all-gathered K and V under an explicit mask: context_parallel_document_mask
// all-gathers the ids over the cp group: [batch, 1, seq_local, cp * seq_local] booleans, the keys in cp-rank
// order (rank 0's chunks, then rank 1's, ...). Collective.
at::Tensor context_parallel_document_mask(const at::Tensor& document_ids, const ProcessGroupPtr& cp_group,
                                          CpLoadBalancer balancer);
// Attention of this rank's queries over every rank's keys and values under such a mask: K and V all-gathered
// (cp-rank order, as the mask), libtorch's SDPA, and in backward dK, dV reduce-scattered back to their owners.
// Every rank holds every rank's K and V and a [seq_local, cp * seq_local] mask for the call (more than
// block_causal_ring_attention under either rotate method; docs/context_parallel.md measures both). Any mask of
// that layout. q, k, v as ring_attention's. Differentiable in q, k and v.
at::Tensor context_parallel_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& mask, const ProcessGroupPtr& cp_group);

// The global chunk indices cp rank `cp_rank` holds, in its local order ({i, 2cp-1-i} or {i}), and how many
// chunks the sequence is cut into (2cp or cp).
std::vector<int64_t> context_parallel_chunk_ids(int64_t cp_rank, int64_t cp_size, CpLoadBalancer balancer);
int64_t context_parallel_num_chunks(int64_t cp_size, CpLoadBalancer balancer);

// Refuses (one error naming the rule) a sequence length the layout cannot cut evenly.
void check_context_parallel_seq_len(int64_t seq_len, int64_t cp_size, CpLoadBalancer balancer);

// This rank's chunks of `global` along `seq_dim` (a copy, contiguous), and the inverse over the cp group (an
// all-gather; every cp rank calls it). Not differentiable: for inputs, labels, positions and for checks.
at::Tensor context_parallel_shard(const at::Tensor& global, int64_t seq_dim, int64_t cp_rank, int64_t cp_size,
                                  CpLoadBalancer balancer);
at::Tensor context_parallel_unshard(const at::Tensor& local, int64_t seq_dim, ProcessGroup& cp_group,
                                    CpLoadBalancer balancer);

// The global position ids (int64, [seq_len / cp]) of this rank's tokens: RoPE follows the chunks.
at::Tensor context_parallel_positions(int64_t seq_len, int64_t cp_rank, int64_t cp_size, CpLoadBalancer balancer);

}  // namespace fsdp
