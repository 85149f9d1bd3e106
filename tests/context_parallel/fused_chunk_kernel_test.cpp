// The ring's kernel choice per chunk pair (src/context_parallel/fused_chunk_attention.h), checked without a GPU:
// the CUDA kernels' own constraints (SDPA's dispatch rules in libtorch's sdp_utils) decide between flash,
// memory-efficient and the math path; off CUDA the fused path is never taken, and attend_fused declines CPU
// tensors, so the CPU ring keeps libtorch's CPU flash (context_parallel_test, block_causal_ring_test). The GPU
// run of the kernels themselves is tests/device/cuda_ring_attention_test.cpp.
#include "context_parallel/fused_chunk_attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using fsdp::detail::FusedChunkKernel;
using fsdp::detail::fused_chunk_kernel;
constexpr auto kCuda = c10::DeviceType::CUDA;

TEST(FusedChunkKernel, FlashForHalfPrecisionUnmaskedPairs) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    EXPECT_EQ(fused_chunk_kernel(kCuda, dtype, 64, 64, /*masked=*/false), FusedChunkKernel::Flash);
    EXPECT_EQ(fused_chunk_kernel(kCuda, dtype, 128, 128, false), FusedChunkKernel::Flash);
    EXPECT_EQ(fused_chunk_kernel(kCuda, dtype, 256, 256, false), FusedChunkKernel::Flash);
  }
}

TEST(FusedChunkKernel, MemoryEfficientWhereFlashCannot) {
  // A masked (block_causal) pair: flash takes no mask.
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kBFloat16, 64, 64, /*masked=*/true), FusedChunkKernel::Efficient);
  // fp32: flash takes 16-bit types only.
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kFloat, 64, 64, false), FusedChunkKernel::Efficient);
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kFloat, 64, 64, true), FusedChunkKernel::Efficient);
  // v's head dim other than q/k's (DeepSeek-V3's MLA: 192 and 128), and a head dim above flash's 256.
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kBFloat16, 192, 128, false), FusedChunkKernel::Efficient);
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kHalf, 512, 512, false), FusedChunkKernel::Efficient);
}

TEST(FusedChunkKernel, MathForTheRest) {
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kDouble, 64, 64, false), FusedChunkKernel::None);  // no fused fp64
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kBFloat16, 60, 60, false), FusedChunkKernel::None);  // not a multiple of 8
  EXPECT_EQ(fused_chunk_kernel(kCuda, at::kFloat, 64, 20, true), FusedChunkKernel::None);
  for (auto device : {c10::DeviceType::CPU, c10::DeviceType::Meta}) {
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat})
      EXPECT_EQ(fused_chunk_kernel(device, dtype, 64, 64, false), FusedChunkKernel::None) << device;
  }
  EXPECT_STREQ(fsdp::detail::to_string(FusedChunkKernel::None), "math");
}

TEST(FusedChunkKernel, CpuTensorsKeepTheCpuPath) {
  const auto q = torch::randn({1, 2, 8, 64}, torch::kBFloat16);
  EXPECT_EQ(fused_chunk_kernel(q, q, q, false), FusedChunkKernel::None);
  EXPECT_FALSE(fsdp::detail::attend_fused(q, q, q, /*causal=*/true, 0.125, {}).has_value());
  EXPECT_FALSE(fsdp::detail::attend_backward_fused(q, q, q, q, q, torch::zeros({1, 2, 8}), true, 0.125, {})
                   .has_value());
}

}  // namespace
