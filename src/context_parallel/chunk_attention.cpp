// The per-chunk attention kernels of ring attention (context_parallel/chunk_attention.h).

#include "context_parallel/chunk_attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

namespace fsdp::detail {
namespace {

// True where the key is in the future of the query (square diagonal chunks only).
at::Tensor future_mask(int64_t lq, int64_t lk, const at::TensorOptions& options) {
  return at::ones({lq, lk}, options.dtype(at::kBool)).triu(1);
}

at::Tensor scaled_scores(const at::Tensor& qf, const at::Tensor& kf, bool causal, double scale) {
  auto scores = at::matmul(qf, kf.transpose(-2, -1)) * scale;
  if (causal) scores.masked_fill_(future_mask(qf.size(2), kf.size(2), scores.options()), -INFINITY);
  return scores;
}

}  // namespace

BlockResult attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  if (!q.device().is_cpu()) return attend_math(q, k, v, causal, scale);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
  return {out.to(at::kFloat), lse.to(at::kFloat)};
}

BlockResult attend_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  const auto scores = scaled_scores(q.to(at::kFloat), k.to(at::kFloat), causal, scale);
  auto lse = at::logsumexp(scores, -1);
  auto out = at::matmul((scores - lse.unsqueeze(-1)).exp(), v.to(at::kFloat));
  return {out, lse};
}

BlockGrads attend_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, bool causal, double scale) {
  if (!q.device().is_cpu()) return attend_backward_math(dout, q, k, v, out, lse, causal, scale);
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, std::nullopt, scale);
  return {dq.to(at::kFloat), dk.to(at::kFloat), dv.to(at::kFloat)};
}

BlockGrads attend_backward_math(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, double scale) {
  const auto qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat), doutf = dout.to(at::kFloat);
  const auto p = (scaled_scores(qf, kf, causal, scale) - lse.unsqueeze(-1)).exp();
  const auto dv = at::matmul(p.transpose(-2, -1), doutf);
  const auto dp = at::matmul(doutf, vf.transpose(-2, -1));
  const auto delta = (doutf * out.to(at::kFloat)).sum(-1, /*keepdim=*/true);  // rowsum(dO * O), the softmax term
  const auto ds = p * (dp - delta);
  return {at::matmul(ds, kf) * scale, at::matmul(ds.transpose(-2, -1), qf) * scale, dv};
}

}  // namespace fsdp::detail
