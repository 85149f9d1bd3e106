// The per-chunk attention kernels of ring attention (context_parallel/chunk_attention.h).

#include "context_parallel/chunk_attention.h"

#include "context_parallel/fused_chunk_attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

namespace fsdp::detail {
namespace {

// True where the key is in the future of the query (square diagonal chunks only).
at::Tensor future_mask(int64_t lq, int64_t lk, const at::TensorOptions& options) {
  return at::ones({lq, lk}, options.dtype(at::kBool)).triu(1);
}

at::Tensor scaled_scores(const at::Tensor& qf, const at::Tensor& kf, bool causal, double scale,
                         const at::Tensor& mask) {
  auto scores = at::matmul(qf, kf.transpose(-2, -1)) * scale;
  if (causal) scores.masked_fill_(future_mask(qf.size(2), kf.size(2), scores.options()), -INFINITY);
  if (mask.defined()) scores.add_(mask.to(at::kFloat));
  return scores;
}

// Rows of a masked chunk that see none of its keys: [B, 1, Lq] (broadcasts over heads).
at::Tensor rows_without_keys(const at::Tensor& mask) { return mask.isneginf().all(-1); }

// A row with no visible key contributes nothing: out 0 and lse -inf (CPU flash leaves lse 0 there, which the
// merge would weigh as exp(0)).
void empty_rows_contribute_nothing(BlockResult& r, const at::Tensor& mask) {
  if (!mask.defined()) return;
  const at::Tensor empty = rows_without_keys(mask);
  r.lse.masked_fill_(empty, -INFINITY);
  r.out.masked_fill_(empty.unsqueeze(-1), 0.0);
}

}  // namespace

BlockResult attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                   const at::Tensor& mask) {
  if (std::optional<BlockResult> fused = attend_fused(q, k, v, causal, scale, mask)) {  // CUDA
    empty_rows_contribute_nothing(*fused, mask);
    return std::move(*fused);
  }
  if (!q.device().is_cpu()) return attend_math(q, k, v, causal, scale, mask);
  const std::optional<at::Tensor> attn_mask = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask, scale);
  BlockResult r{out.to(at::kFloat), lse.to(at::kFloat)};
  empty_rows_contribute_nothing(r, mask);
  return r;
}

BlockResult attend_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                        const at::Tensor& mask) {
  const auto scores = scaled_scores(q.to(at::kFloat), k.to(at::kFloat), causal, scale, mask);
  auto lse = at::logsumexp(scores, -1);  // -inf on rows without a visible key
  // exp(-inf - 0) = 0 on such rows, instead of exp(-inf - -inf) = NaN.
  const auto finite_lse = lse.masked_fill(lse.isneginf(), 0.0);
  auto out = at::matmul((scores - finite_lse.unsqueeze(-1)).exp(), v.to(at::kFloat));
  return {out, lse};
}

BlockGrads attend_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
                           const at::Tensor& mask) {
  if (std::optional<BlockGrads> fused = attend_backward_fused(dout, q, k, v, out, lse, causal, scale, mask))  // CUDA
    return std::move(*fused);
  if (!q.device().is_cpu()) return attend_backward_math(dout, q, k, v, out, lse, causal, scale, mask);
  const std::optional<at::Tensor> attn_mask = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, attn_mask, scale);
  return {dq.to(at::kFloat), dk.to(at::kFloat), dv.to(at::kFloat)};
}

BlockGrads attend_backward_math(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
                                const at::Tensor& mask) {
  const auto qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat), doutf = dout.to(at::kFloat);
  const auto p = (scaled_scores(qf, kf, causal, scale, mask) - lse.unsqueeze(-1)).exp();
  const auto dv = at::matmul(p.transpose(-2, -1), doutf);
  const auto dp = at::matmul(doutf, vf.transpose(-2, -1));
  const auto delta = (doutf * out.to(at::kFloat)).sum(-1, /*keepdim=*/true);  // rowsum(dO * O), the softmax term
  const auto ds = p * (dp - delta);
  return {at::matmul(ds, kf) * scale, at::matmul(ds.transpose(-2, -1), qf) * scale, dv};
}

}  // namespace fsdp::detail
