#pragma once
// Ring attention's chunk kernels on CUDA (src/context_parallel/chunk_attention.cpp asks here first): libtorch's
// fused kernels that return the log-sum-exp the ring merges by, as PyTorch's own ring uses them
// (torch.distributed.tensor.experimental._context_parallel: _scaled_dot_product_flash_attention and
// _scaled_dot_product_efficient_attention, and their backward given the global output and LSE). Device-generic
// code: it compiles against any libtorch and calls the CUDA kernels only for CUDA tensors; on other devices (and
// for what the kernels do not take) the caller keeps its own path.
//
// Which kernel (the CUDA kernels' own rules, those of SDPA's dispatch in sdp_utils):
//   - flash: fp16/bf16, no mask (causal or full), q/k/v head dims equal, a multiple of 8 and at most 256;
//   - memory-efficient: fp32/fp16/bf16, also with a mask (block_causal's document mask as an additive bias),
//     qk and v head dims multiples of 8 (v's may differ);
//   - none (the caller's exact math in fp32): anything else, e.g. fp64, or head dims not a multiple of 8.
//
// Private to src/context_parallel (and its tests).

#include "context_parallel/chunk_attention.h"

#include <optional>

namespace fsdp::detail {

enum class FusedChunkKernel { None, Flash, Efficient };

// The kernel a chunk pair of these q, k, v (and a mask or not) takes; None off CUDA. The rule itself, from the
// pair's device, dtype and head dims (checkable without a GPU), and for tensors.
FusedChunkKernel fused_chunk_kernel(c10::DeviceType device, at::ScalarType dtype, int64_t qk_head_dim,
                                    int64_t v_head_dim, bool masked);
FusedChunkKernel fused_chunk_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool masked);
const char* to_string(FusedChunkKernel kernel);

// attend / attend_backward (chunk_attention.h) through the fused kernel, or nullopt where fused_chunk_kernel says
// None. The result's out/lse and the gradients are float, as the other paths'. A masked row without a visible key
// is left to the caller (attend sets it to out 0, lse -inf).
std::optional<BlockResult> attend_fused(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                        double scale, const at::Tensor& mask);
std::optional<BlockGrads> attend_backward_fused(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                bool causal, double scale, const at::Tensor& mask);

}  // namespace fsdp::detail
