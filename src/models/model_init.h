#pragma once
// What the model families of src/models share when they build and initialise parameters (llama.cpp defines
// them; deepseek_v3.cpp uses them too), so that every family draws its init the same way.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "models/generator_skip.h"

#include <cstdint>
#include <optional>

namespace fsdp::models::llama::detail {

// A truncated normal N(0, std) cut at [a, b], drawn on the CPU from `gen` (inverse CDF) and copied into `param`.
void trunc_normal_(at::Tensor& param, double std, double a, double b, at::Generator& gen);
// N(0, std) drawn on the CPU from `gen`, copied into `param`.
void normal_(at::Tensor& param, double std, at::Generator& gen);
// The generator outputs that Tensor::normal_ takes to fill a contiguous float CPU tensor of `numel` elements:
// torch's normal_fill draws one uniform each, then 16 more for the last block when numel % 16 != 0; nullopt below
// 16 elements, where torch's serial path draws pairs and caches one sample in the generator.
std::optional<uint64_t> normal_fill_outputs(int64_t numel);
// Both helpers skip a `meta` parameter's draw under a MetaDrawSkipping of `gen` (generator_skip.h).

}  // namespace fsdp::models::llama::detail
