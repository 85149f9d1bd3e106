#pragma once
// The per-chunk attention kernels of ring attention (src/context_parallel/context_parallel.cpp): attention of a
// query chunk against one key/value chunk with its log-sum-exp, and the chunk pair's gradients from the GLOBAL
// output and log-sum-exp. attend / attend_backward pick by device: libtorch's CPU flash attention on the CPU,
// its CUDA flash or memory-efficient kernel on CUDA where their dtype and shape rules allow
// (fused_chunk_attention.h), the exact math in float elsewhere (chunk-sized scores only). The math kernels are
// callable on the CPU too, so the tests check the path other devices take.
//
// Private to src/context_parallel (and its tests).

#include <ATen/core/Tensor.h>

namespace fsdp::detail {

struct BlockResult {
  at::Tensor out;  // [B, H, Lq, D], float
  at::Tensor lse;  // [B, H, Lq], float
};

struct BlockGrads {
  at::Tensor dq, dk, dv;  // float
};

// causal: the diagonal chunk (square; key j visible to query i when j <= i). mask (optional, instead of causal):
// an additive mask in q's dtype, [B, 1, Lq, Lk] (0: visible, -inf: hidden), e.g. a document mask; a row that sees
// no key of the chunk gets out = 0 and lse = -inf, so that it merges as "nothing from this chunk".
BlockResult attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                   const at::Tensor& mask = {});
BlockResult attend_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                        const at::Tensor& mask = {});

// Softmax probabilities recomputed against the global normaliser `lse` are the pair's share of the full
// attention, so the pair's dq, dk, dv summed over all pairs are the full attention's. `out` is the queries'
// final (merged) output, `dout` its gradient; `lse` is finite (every query sees some key over the whole sequence).
BlockGrads attend_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
                           const at::Tensor& mask = {});
BlockGrads attend_backward_math(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
                                const at::Tensor& mask = {});

}  // namespace fsdp::detail
