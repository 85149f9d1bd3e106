// Global-norm gradient clipping over FSDP-sharded parameters.
#include <fsdp/clip_grad.h>

#include "fully_shard/fsdp_state.h"

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
  std::unordered_map<const c10::TensorImpl*, std::string> group_of;  // -> shard group name
  std::map<std::string, ProcessGroupPtr> groups;
  for (const auto& sub : root.modules(/*include_self=*/true)) {
    auto s = detail::find_state(*sub);
    if (!s || !s->param_group()) continue;
    const auto& g = s->param_group()->mesh_info().shard_group;
    groups.emplace(g->name(), g);
    for (auto* p : s->param_group()->params()) {
      // A 0-dim parameter is held whole by every rank of its group: it counts once, like a replicated one.
      if (!p->is_replicated()) group_of[p->param().unsafeGetTensorImpl()] = g->name();
    }
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
    groups.at(name)->all_reduce(buf, inf_norm ? ReduceOp::Max : ReduceOp::Sum).wait();
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
