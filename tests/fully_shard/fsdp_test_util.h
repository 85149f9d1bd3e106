#pragma once
// Shared pieces of the fully_shard tests: small models, a single-process reference trainer, and a way to
// read an FSDP model's full parameters. The reference is plain libtorch on one process, trained on the
// whole global batch — it shares no code with fully_shard.

#include "comm/dist_env.h"
#include "fully_shard/mlp_model.h"

#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/sharded_tensor.h>
#include <fsdp/state_dict.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <unordered_set>
#include <string>
#include <vector>

namespace fsdp_test {

// fully_shard every block, then the root (bottom-up), with the same options.
inline std::vector<fsdp::FSDPModule> shard_mlp(MLP& model, const fsdp::FullyShardOptions& opts) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->blocks[i], opts));
  units.push_back(fsdp::fully_shard(model, opts));
  return units;
}

// Deterministic global batch for step `step`: every rank can build it.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t batch, int64_t in, int64_t out) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({batch, in}, gen);
  auto y = torch::randn({batch, out}, gen);
  return {x, y};
}

// All parameters of an FSDP model gathered to full tensors, by FQN: the fp32 sharded (master) parameters,
// all-gathered one by one (full_state_dict), on every rank.
inline std::map<std::string, torch::Tensor> full_params(torch::nn::Module& root, const std::vector<fsdp::FSDPModule>&) {
  return fsdp::full_state_dict(root, {/*cpu_offload=*/true, /*rank0_only=*/false});
}

// The parameters of a freshly built make_mlp(seed), by FQN: what a trained model is compared with to show the
// reference (and the run under test) moved.
inline std::map<std::string, torch::Tensor> initial_mlp_params(uint64_t seed) {
  MLP m = make_mlp(seed);
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

inline double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(denom, 1e-12);
}

// Deduplicated parameters (libtorch's parameters() lists a tied tensor once per owner), for optimizers.
inline std::vector<torch::Tensor> unique_params(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

// A plain model's parameters by FQN, a tied tensor once under its first name (as full_state_dict lists it).
inline std::map<std::string, torch::Tensor> reference_params(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out[item.key()] = item.value().detach().clone();
  }
  return out;
}

// Full gradients of an FSDP model by FQN: every sharded .grad gathered with its state-dict placement (a tied
// tensor once, under its first name, as full_state_dict lists it).
inline std::map<std::string, torch::Tensor> full_grads(torch::nn::Module& root) {
  auto sd = fsdp::sharded_state_dict(root);
  std::map<std::string, torch::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied tensor once, under its first name
  for (const auto& item : root.named_parameters()) {
    auto it = sd.find(item.key());
    if (it == sd.end() || !item.value().grad().defined()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    out[item.key()] = fsdp::ShardedTensor::from_local(item.value().grad().contiguous(), it->second.mesh(),
                                                      it->second.placements(), it->second.sizes())
                          .full_tensor();
  }
  return out;
}

// Same names, and every tensor within `tol` (max relative difference) of the reference's.
inline void expect_equal_maps(const std::map<std::string, torch::Tensor>& got,
                              const std::map<std::string, torch::Tensor>& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (const auto& [name, r] : ref) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_LE(max_rel_diff(got.at(name), r), tol) << what << ": " << name;
  }
}

}  // namespace fsdp_test
