// Global-norm gradient clipping over FSDP-sharded parameters.
#include <fsdp/clip_grad.h>

#include "fully_shard/fsdp_state.h"
#include "tensor/param_spec.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>

namespace fsdp {

at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm, double norm_type) {
  TORCH_CHECK(norm_type == 1.0 || norm_type == 2.0 || std::isinf(norm_type),
              "fsdp::clip_grad_norm_: norm_type must be 1, 2 or inf, got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  c10::NoGradGuard no_grad;

  // Which shard group each FSDP-managed parameter is sharded over. A gradient shard contributes its partial
  // norm, summed (or max-ed) across that group; the replicate dim of HSDP holds identical copies and is not
  // summed. Parameters not managed by FSDP are replicated: their norm counts once, locally.
  // Tensor-parallel parameters are also split over their TP group (Shard placements; a Replicate one, e.g. a
  // sequence-parallel norm weight, is whole on every TP rank and not summed there). A partial is summed over
  // every group that splits its parameters, in turn. Keys name the mesh dims (not the slice: "mesh[tp]#1" on
  // one rank is "mesh[tp]#0" on another), so every rank runs the same all-reduces in the same order.
  auto dim_key = [](const ProcessGroupPtr& g) { return g->name().substr(0, g->name().rfind('#')); };
  std::unordered_map<const c10::TensorImpl*, std::string> group_of;  // -> key of its reduction groups
  std::map<std::string, std::vector<ProcessGroupPtr>> groups;
  const auto tp_specs = tp::collect_specs(root);
  auto add = [&](const at::Tensor& param, std::vector<ProcessGroupPtr> reduce_over) {
    std::string key;
    for (const auto& g : reduce_over) key += (key.empty() ? "" : "|") + dim_key(g);
    groups.emplace(key, std::move(reduce_over));
    group_of[param.unsafeGetTensorImpl()] = key;
  };
  auto tp_group = [&](const at::Tensor& param) -> ProcessGroupPtr {
    auto it = tp_specs.find(param.unsafeGetTensorImpl());
    if (it == tp_specs.end() || !it->second.placements.front().is_shard()) return nullptr;
    return it->second.mesh.group(0);
  };
  for (const auto& sub : root.modules(/*include_self=*/true)) {
    auto s = detail::find_state(*sub);
    if (!s || !s->param_group()) continue;
    const auto& g = s->param_group()->mesh_info().shard_group;
    for (auto* p : s->param_group()->params()) {
      std::vector<ProcessGroupPtr> over;
      // A 0-dim parameter is held whole by every rank of its group: it counts once, like a replicated one.
      if (!p->is_replicated()) over.push_back(g);
      if (auto t = tp_group(p->param())) over.push_back(t);
      if (!over.empty()) add(p->param(), std::move(over));
    }
  }
  for (const auto& [impl, spec] : tp_specs) {  // TP without FSDP on its module
    if (group_of.count(impl) || !spec.placements.front().is_shard()) continue;
    const std::vector<ProcessGroupPtr> over{spec.mesh.group(0)};
    std::string key = dim_key(over.front());
    groups.emplace(key, over);
    group_of[impl] = key;
  }

  // Keyed by group name so that every rank runs the all-reduces in the same order.
  std::map<std::string, at::Tensor> sharded_partials;  // per shard group: sum |g|^p (or max |g|)
  at::Tensor replicated_partial = at::zeros({}, at::kFloat);
  std::vector<at::Tensor> grads;
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  for (const auto& p : root.parameters(/*recurse=*/true)) {
    if (!seen.emplace(p.unsafeGetTensorImpl(), true).second) continue;  // tied parameters count once
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    at::Tensor gf = g.to(at::kFloat);
    at::Tensor part = inf_norm ? (gf.numel() ? gf.abs().max() : at::zeros({}, gf.options()))
                               : (norm_type == 1.0 ? gf.abs().sum() : gf.pow(2).sum());
    auto it = group_of.find(p.unsafeGetTensorImpl());
    at::Tensor& acc = it == group_of.end() ? replicated_partial : [&]() -> at::Tensor& {
      auto& t = sharded_partials[it->second];
      if (!t.defined()) t = at::zeros({}, gf.options());
      return t;
    }();
    part = part.to(acc.device());
    acc = inf_norm ? at::maximum(acc, part) : acc + part;
  }
  // Every rank must enter the same all-reduces even if it holds no gradient shard (empty trailing shards):
  // make sure each known group has an entry.
  for (auto& [name, g] : groups) {
    auto& t = sharded_partials[name];
    if (!t.defined()) t = at::zeros({}, at::kFloat);
  }
  at::Tensor total = replicated_partial.clone();
  for (auto& [name, partial] : sharded_partials) {
    at::Tensor buf = partial.reshape({1}).contiguous();
    for (const auto& g : groups.at(name)) g->all_reduce(buf, inf_norm ? ReduceOp::Max : ReduceOp::Sum).wait();
    total = inf_norm ? at::maximum(total, buf.reshape({}).to(total.device())) : total + buf.reshape({}).to(total.device());
  }
  if (!inf_norm && norm_type == 2.0) total = total.sqrt();
  const double total_norm = total.item<double>();
  const double clip_coef = max_norm / (total_norm + 1e-6);
  if (clip_coef < 1.0) {
    for (auto& g : grads) g.mul_(clip_coef);
  }
  return total;
}

}  // namespace fsdp
