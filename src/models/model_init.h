#pragma once
// What the model families of src/models share when they build and initialise parameters (llama.cpp defines
// them; deepseek_v3.cpp uses them too), so that every family draws its init the same way.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

namespace fsdp::nn::llama::detail {

// A truncated normal N(0, std) cut at [a, b], drawn on the CPU from `gen` (inverse CDF) and copied into `param`.
void trunc_normal_(at::Tensor& param, double std, double a, double b, at::Generator& gen);
// N(0, std) drawn on the CPU from `gen`, copied into `param`.
void normal_(at::Tensor& param, double std, at::Generator& gen);

}  // namespace fsdp::nn::llama::detail
