#pragma once
// The per-chunk attention kernels of ring attention (src/context_parallel/context_parallel.cpp): attention of a
// query chunk against one key/value chunk with its log-sum-exp, and the chunk pair's gradients from the GLOBAL
// output and log-sum-exp. attend / attend_backward pick by device: libtorch's CPU flash attention on the CPU,
// the exact math in float elsewhere (chunk-sized scores only). The math kernels are callable on the CPU too, so
// the tests check the path other devices take.
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

// causal: the diagonal chunk (square; key j visible to query i when j <= i).
BlockResult attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale);
BlockResult attend_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale);

// Softmax probabilities recomputed against the global normaliser `lse` are the pair's share of the full
// attention, so the pair's dq, dk, dv summed over all pairs are the full attention's. `out` is the queries'
// final (merged) output, `dout` its gradient.
BlockGrads attend_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, bool causal, double scale);
BlockGrads attend_backward_math(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, double scale);

}  // namespace fsdp::detail
