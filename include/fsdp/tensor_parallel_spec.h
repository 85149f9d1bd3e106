#pragma once
// What tensor parallelism recorded for a parameter: PyTorch's DTensor spec of a TP-sharded parameter. A fact
// about the tensor (its global shape and placement over the TP mesh), so it lives in the tensor layer:
// fully_shard, state dicts and checkpoints read it without depending on the tensor-parallel styles that write it
// (<fsdp/tensor_parallel.h>, which includes this header).

#include <fsdp/device_mesh.h>
#include <fsdp/sharded_tensor.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fsdp {

// What parallelize_module recorded for a parameter: the global tensor of `global_shape`, placed over `mesh`
// (the TP mesh) by `placements`; the parameter holds this rank's piece.
struct TensorParallelSpec {
  DeviceMesh mesh;
  Placements placements;
  std::vector<int64_t> global_shape;
};
// The spec of `param` (one of `root`'s parameters, found by identity), or nullopt when it is not TP-sharded.
std::optional<TensorParallelSpec> tensor_parallel_spec(const torch::nn::Module& root, const at::Tensor& param);

}  // namespace fsdp
