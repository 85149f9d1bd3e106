#pragma once
// Shared pieces of the tensor-parallel tests: full values of a TP (and FSDP) model's parameters, and the
// collective counters of a group.

#include "comm/dist_env.h"

#include <fsdp/device_mesh.h>
#include <fsdp/sharded_tensor.h>
#include <fsdp/tensor_parallel.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

namespace fsdp_test {

// Every parameter of a tensor-parallel model as its full tensor (collective: gathers the TP-sharded ones).
inline std::map<std::string, torch::Tensor> full_tp_params(torch::nn::Module& root) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : root.named_parameters()) {
    auto spec = fsdp::tensor_parallel_spec(root, item.value());
    if (!spec) {
      out[item.key()] = item.value().detach().clone();
      continue;
    }
    out[item.key()] =
        fsdp::ShardedTensor::from_local(item.value().detach(), spec->mesh, spec->placements, spec->global_shape)
            .full_tensor();
  }
  return out;
}

inline void expect_params_close(const std::map<std::string, torch::Tensor>& got,
                                const std::map<std::string, torch::Tensor>& want, double tol,
                                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": missing " << name;
    ASSERT_EQ(it->second.sizes(), w.sizes()) << what << ": " << name;
    const double diff = (it->second - w).abs().max().item<double>();
    EXPECT_LE(diff, tol) << what << ": " << name << " differs by " << diff;
  }
}

// The reference must have moved, or the comparison proves nothing.
inline double max_change(const std::map<std::string, torch::Tensor>& before,
                         const std::map<std::string, torch::Tensor>& after) {
  double m = 0;
  for (const auto& [name, b] : before) m = std::max(m, (after.at(name) - b).abs().max().item<double>());
  return m;
}

inline std::map<std::string, torch::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

}  // namespace fsdp_test
