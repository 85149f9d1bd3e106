// Global-norm gradient clipping over FSDP-sharded parameters.
#include <fsdp/clip_grad.h>

#include "fully_shard/fsdp_state.h"
#include "tensor/param_spec.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>

namespace fsdp {

namespace {

void check_norm_type(double norm_type) {
  // torch accepts any float here, but only p > 0 clips by a size: p = 0 counts the gradient tensors that have a
  // nonzero entry, p < 0 and -inf give 0 as soon as one entry is 0 (no clipping), NaN turns every gradient into
  // NaN. Those are refused rather than reproduced.
  TORCH_CHECK(norm_type > 0, "fsdp::clip_grad_norm_: norm_type must be > 0 (a p-norm: 1, 2, 3, 0.5, ..., or ",
              "infinity for the max-norm), got ", norm_type);
}

// The model's sum of |g|^p over every full gradient (max |g| for the inf-norm), as a 0-dim fp32 tensor, reduced
// over the meshes that shard the gradients; appends the gradients to `grads`. Collective over those meshes.
at::Tensor norm_partial(torch::nn::Module& root, double norm_type, std::vector<at::Tensor>& grads) {
  const bool inf_norm = std::isinf(norm_type);

  // Which shard group each FSDP-managed parameter is sharded over. A gradient shard contributes its partial
  // norm, summed (or max-ed) across that group; the replicate dim of HSDP holds identical copies and is not
  // summed. Parameters not managed by FSDP are replicated: their norm counts once, locally.
  // Tensor-parallel parameters are also split over their TP group (Shard placements; a Replicate one, e.g. a
  // sequence-parallel norm weight, is whole on every TP rank and not summed there). A partial is summed over
  // every group that splits its parameters, in turn. Keys name the mesh dim by its root mesh's layout and the
  // dim's name, the same on every rank (not the slice: "mesh[tp]#1" on one rank is "mesh[tp]#0" on another),
  // so every rank runs the same all-reduces in the same order; and a dim of two different meshes with the same
  // name (a dense and an expert mesh both calling it "shard": per-parameter meshes) stays two reductions
  // instead of one summed over the wrong ranks (PyTorch's clip_grad_norm_ fails on mixed meshes, pytorch#180346).
  using MeshDim = std::pair<DeviceMesh, int64_t>;
  auto dim_key = [](const MeshDim& d) {
    return c10::str(detail::mesh_identity(d.first.root()), "/", d.first.dim_names()[d.second]);
  };
  std::unordered_map<const c10::TensorImpl*, std::string> group_of;  // -> key of its reduction groups
  std::map<std::string, std::vector<ProcessGroupPtr>> groups;
  const auto tp_specs = tp::collect_specs(root);
  auto add = [&](const c10::TensorImpl* param, const std::vector<MeshDim>& reduce_over) {
    std::string key;
    std::vector<ProcessGroupPtr> over;
    for (const auto& d : reduce_over) {
      key += (key.empty() ? "" : "|") + dim_key(d);
      over.push_back(d.first.group(d.second));
    }
    groups.emplace(key, std::move(over));
    group_of[param] = key;
  };
  auto tp_dim = [&](const at::Tensor& param) -> std::optional<MeshDim> {
    auto it = tp_specs.find(param.unsafeGetTensorImpl());
    if (it == tp_specs.end() || !it->second.placements.front().is_shard()) return std::nullopt;
    return MeshDim{it->second.mesh, 0};
  };
  for (const auto& sub : root.modules(/*include_self=*/true)) {
    auto s = detail::find_state(*sub);
    if (!s) continue;
    for (auto* group : s->param_groups()) {  // one per mesh of the state
      const DeviceMesh& mesh = group->mesh_info().mesh;
      for (auto* p : group->params()) {
        std::vector<MeshDim> over;
        // A 0-dim parameter is held whole by every rank of its group: it counts once, like a replicated one.
        if (!p->is_replicated()) over.emplace_back(mesh, mesh.ndim() - 1);  // the shard dim
        if (auto t = tp_dim(p->param())) over.push_back(*t);
        if (!over.empty()) add(p->param().unsafeGetTensorImpl(), over);
      }
    }
  }
  for (const auto& [impl, spec] : tp_specs) {  // TP without FSDP on its module
    if (group_of.count(impl) || !spec.placements.front().is_shard()) continue;
    add(impl, {MeshDim{spec.mesh, 0}});
  }

  // Keyed by mesh identity so that every rank runs the all-reduces in the same order.
  std::map<std::string, at::Tensor> sharded_partials;  // per shard group: sum |g|^p (or max |g|)
  at::Tensor replicated_partial = at::zeros({}, at::kFloat);
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  for (const auto& p : root.parameters(/*recurse=*/true)) {
    if (!seen.emplace(p.unsafeGetTensorImpl(), true).second) continue;  // tied parameters count once
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    at::Tensor gf = g.to(at::kFloat);
    // sum |g|^p over this rank's piece: summed over ranks and parameters, then the p-th root.
    at::Tensor part = inf_norm           ? (gf.numel() ? gf.abs().max() : at::zeros({}, gf.options()))
                      : norm_type == 1.0 ? gf.abs().sum()
                      : norm_type == 2.0 ? gf.pow(2).sum()
                                         : gf.abs().pow(norm_type).sum();
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
  return total;
}

// The p-th root of the summed partials, then every gradient scaled by max_norm / (norm + 1e-6) when below 1.
at::Tensor clip_with_partial(at::Tensor total, double max_norm, double norm_type, std::vector<at::Tensor>& grads) {
  const bool inf_norm = std::isinf(norm_type);
  if (!inf_norm && norm_type == 2.0) total = total.sqrt();
  else if (!inf_norm && norm_type != 1.0) total = total.pow(1.0 / norm_type);
  const double total_norm = total.item<double>();
  const double clip_coef = max_norm / (total_norm + 1e-6);
  if (clip_coef < 1.0) {
    for (auto& g : grads) g.mul_(clip_coef);
  }
  return total;
}

}  // namespace

at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm, double norm_type) {
  check_norm_type(norm_type);
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  at::Tensor total = norm_partial(root, norm_type, grads);
  return clip_with_partial(std::move(total), max_norm, norm_type, grads);
}

at::Tensor clip_grad_norm_(const std::vector<std::shared_ptr<torch::nn::Module>>& parts, double max_norm,
                           double norm_type, const ProcessGroupPtr& across) {
  check_norm_type(norm_type);
  c10::NoGradGuard no_grad;
  const bool inf_norm = std::isinf(norm_type);
  std::vector<at::Tensor> grads;
  at::Tensor total = at::zeros({}, at::kFloat);
  for (const auto& part : parts) {
    TORCH_CHECK(part, "fsdp::clip_grad_norm_: a null model part");
    at::Tensor partial = norm_partial(*part, norm_type, grads).to(total.device());
    total = inf_norm ? at::maximum(total, partial) : total + partial;
  }
  if (across && across->size() > 1) {
    // Each pipeline rank holds other parameters: their |g|^p add up (the inf-norm takes the max), as TorchTitan's
    // clip_grad_norm_ all-reduces over the pp mesh.
    at::Tensor buf = total.reshape({1}).to(across->device()).contiguous();
    across->all_reduce(buf, inf_norm ? ReduceOp::Max : ReduceOp::Sum).wait();
    total = buf.reshape({}).to(at::kCPU);
  }
  return clip_with_partial(std::move(total), max_norm, norm_type, grads);
}

}  // namespace fsdp
