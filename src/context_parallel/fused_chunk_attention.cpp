// Ring attention's chunk kernels on CUDA (context_parallel/fused_chunk_attention.h).

#include "context_parallel/fused_chunk_attention.h"

#include <ATen/ATen.h>

#include <array>
#include <limits>

namespace fsdp::detail {
namespace {

bool half_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The kernels read rows of head_dim elements: the last dim must be dense (a chunk cut along the sequence is).
at::Tensor dense_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// The memory-efficient kernel reads the bias in 16-element aligned rows: padded, then cut back (a view whose
// rows start aligned), and expanded over the heads without a copy; what SDPA's own dispatch does
// (preprocess_mask in sdp_utils). `mask`: [B, 1, Lq, Lk] additive, in q's dtype.
at::Tensor efficient_bias(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  constexpr int64_t kAlignment = 16;
  const int64_t lk = mask.size(-1);
  at::Tensor bias = mask.to(q.scalar_type());
  if (lk % kAlignment != 0) bias = at::constant_pad_nd(bias, {0, kAlignment - lk % kAlignment}, 0).narrow(-1, 0, lk);
  return bias.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

// No dropout: the kernels' random state is never read, but their signatures take it (the forward returns these).
at::Tensor no_philox() { return at::empty({}, at::TensorOptions().dtype(at::kLong)); }

}  // namespace

FusedChunkKernel fused_chunk_kernel(c10::DeviceType device, at::ScalarType dtype, int64_t qk_dim, int64_t v_dim,
                                    bool masked) {
  if (device != c10::DeviceType::CUDA) return FusedChunkKernel::None;
  const bool dims_of_8 = qk_dim % 8 == 0 && v_dim % 8 == 0 && qk_dim > 0 && v_dim > 0;
  if (!masked && half_precision(dtype) && dims_of_8 && qk_dim == v_dim && qk_dim <= 256)
    return FusedChunkKernel::Flash;
  if ((half_precision(dtype) || dtype == at::kFloat) && dims_of_8) return FusedChunkKernel::Efficient;
  return FusedChunkKernel::None;
}

FusedChunkKernel fused_chunk_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool masked) {
  const at::ScalarType dtype = q.scalar_type();
  if (k.scalar_type() != dtype || v.scalar_type() != dtype || k.device() != q.device() || v.device() != q.device())
    return FusedChunkKernel::None;
  return fused_chunk_kernel(q.device().type(), dtype, q.size(-1), v.size(-1), masked);
}

const char* to_string(FusedChunkKernel kernel) {
  switch (kernel) {
    case FusedChunkKernel::Flash: return "flash";
    case FusedChunkKernel::Efficient: return "efficient";
    case FusedChunkKernel::None: break;
  }
  return "math";
}

std::optional<BlockResult> attend_fused(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                        double scale, const at::Tensor& mask) {
  const FusedChunkKernel kernel = fused_chunk_kernel(q, k, v, mask.defined());
  if (kernel == FusedChunkKernel::None) return std::nullopt;
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  if (kernel == FusedChunkKernel::Flash) {
    const auto result = at::_scaled_dot_product_flash_attention(qd, kd, vd, /*dropout_p=*/0.0, causal,
                                                                /*return_debug_mask=*/false, scale);
    return BlockResult{std::get<0>(result).to(at::kFloat), std::get<1>(result).to(at::kFloat)};
  }
  const std::optional<at::Tensor> bias =
      mask.defined() ? std::optional<at::Tensor>(efficient_bias(mask, q, k)) : std::nullopt;
  const auto result = at::_scaled_dot_product_efficient_attention(qd, kd, vd, bias, /*compute_log_sumexp=*/true,
                                                                  /*dropout_p=*/0.0, causal, scale);
  // The kernel's LSE rows are padded to a multiple of 32 queries: the first Lq are the chunk's.
  return BlockResult{std::get<0>(result).to(at::kFloat),
                     std::get<1>(result).narrow(-1, 0, q.size(2)).to(at::kFloat)};
}

std::optional<BlockGrads> attend_backward_fused(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                bool causal, double scale, const at::Tensor& mask) {
  const FusedChunkKernel kernel = fused_chunk_kernel(q, k, v, mask.defined());
  if (kernel == FusedChunkKernel::None) return std::nullopt;
  // The kernels take the output and its gradient in the inputs' dtype (the ring merges in float), the LSE in
  // float: the GLOBAL ones, so that each pair's gradients are its share of the full attention's.
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const at::Tensor out_q = out.to(q.scalar_type()).contiguous(), dout_q = dout.to(q.scalar_type()).contiguous();
  const at::Tensor lse_f = lse.to(at::kFloat).contiguous();
  if (kernel == FusedChunkKernel::Flash) {
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_backward(
        dout_q, qd, kd, vd, out_q, lse_f, /*cum_seq_q=*/at::Tensor(), /*cum_seq_k=*/at::Tensor(), q.size(2), k.size(2),
        /*dropout_p=*/0.0, causal, no_philox(), no_philox(), scale);
    return BlockGrads{dq.to(at::kFloat), dk.to(at::kFloat), dv.to(at::kFloat)};
  }
  // The forward's LSE layout: rows padded to a multiple of 32 queries, the padding +inf (as the kernel writes
  // it: a row past the chunk weighs exp(-inf) = 0 wherever a block reads it).
  const int64_t lq = q.size(2), padded = (lq + 31) / 32 * 32;
  const at::Tensor lse_padded =
      padded == lq ? lse_f : at::constant_pad_nd(lse_f, {0, padded - lq}, std::numeric_limits<double>::infinity());
  const at::Tensor bias = mask.defined() ? efficient_bias(mask, q, k) : at::Tensor();
  const auto grads = at::_scaled_dot_product_efficient_attention_backward(
      dout_q, qd, kd, vd, bias, out_q, lse_padded, no_philox(), no_philox(), /*dropout_p=*/0.0,
      std::array<bool, 4>{true, true, true, /*bias=*/false}, causal, scale);
  return BlockGrads{std::get<0>(grads).to(at::kFloat), std::get<1>(grads).to(at::kFloat),
                    std::get<2>(grads).to(at::kFloat)};
}

}  // namespace fsdp::detail
