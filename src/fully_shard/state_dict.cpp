// Sharded and full state dicts of fully_shard models.
#include <fsdp/state_dict.h>
#include <fsdp/tensor_parallel_spec.h>

#include "fully_shard/fsdp_state.h"
#include "tensor/param_spec.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <optional>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

// What the root's tree knows about its parameters: the FSDPParam behind each managed one, and one mesh to
// describe replicated entries with.
struct ModelIndex {
  std::unordered_map<const c10::TensorImpl*, std::pair<detail::FSDPParam*, const detail::MeshInfo*>> managed;
  std::vector<detail::FSDPParamGroup*> groups;
  // Buffers kept in MixedPrecisionPolicy::buffer_dtype: state dicts report them in their original dtype.
  std::unordered_map<const c10::TensorImpl*, c10::ScalarType> buffer_orig_dtype;
  DeviceMesh any_mesh;
  // Under tensor parallelism: the [fsdp..., tp] mesh of a tensor-parallel parameter. Buffers (an MoE block's
  // expert_bias) are replicated over it: described over any_mesh alone, the TP ranks of data-parallel
  // coordinate 0 would each claim the whole buffer, and a checkpoint would see overlapping chunks.
  DeviceMesh tp_mesh;
  // Tensor-parallel parameters (managed ones also carry their layout in their FSDPParam).
  std::unordered_map<const c10::TensorImpl*, TensorParallelSpec> tp_specs;
  at::Tensor unmanaged_value(const at::Tensor& t) const {
    auto it = buffer_orig_dtype.find(t.unsafeGetTensorImpl());
    return it == buffer_orig_dtype.end() ? t.detach() : t.detach().to(it->second);
  }
  // After a load wrote new shards: nothing gathered or kept from the old ones may be used (hpZ copies).
  void invalidate_caches() const {
    for (auto* g : groups) g->invalidate_caches();
  }
};

ModelIndex index_model(torch::nn::Module& root, const char* what) {
  // (what: the public function's name, for messages)
  ModelIndex index;
  for (const auto& sub : root.modules(/*include_self=*/true)) {
    auto s = detail::find_state(*sub);
    if (s) {
      for (const auto& [buffer, dtype] : s->cast_buffers) index.buffer_orig_dtype[buffer.unsafeGetTensorImpl()] = dtype;
    }
    if (!s) continue;
    // Every group of the state (one per mesh): each parameter is described over its own group's mesh.
    for (detail::FSDPParamGroup* g : s->param_groups()) {
      // A group left unsharded after forward (the root keeps its parameters until backward by default, an
      // explicit unshard()) is resharded: the state dict describes shards. A later backward re-gathers.
      if (g->is_unsharded() || g->unshard_in_flight()) g->reshard();
      if (!index.any_mesh.valid()) index.any_mesh = g->mesh_info().mesh;
      index.groups.push_back(g);
      for (auto* p : g->params()) {
        index.managed[p->param().unsafeGetTensorImpl()] = {p, &g->mesh_info()};
        if (!index.tp_mesh.valid() && p->tensor_parallel_layout()) index.tp_mesh = p->tensor_parallel_layout()->mesh;
      }
    }
  }
  index.tp_specs = tp::collect_specs(root);
  TORCH_CHECK(index.any_mesh.valid(), "fsdp::", what, ": no fully_shard module with parameters under ", root.name());
  return index;
}

Placements replicated(const DeviceMesh& mesh) { return Placements(static_cast<size_t>(mesh.ndim()), Replicate()); }

// A 0-dim parameter is replicated inside its group (every rank holds it), the rest are shards on their shard
// dim (0 unless shard_placement_fn chose another).
Placements fsdp_placements(const detail::FSDPParam& param, const detail::MeshInfo& info) {
  if (param.is_replicated()) return replicated(info.mesh);
  if (info.mesh.ndim() == 2) return {Replicate(), Shard(param.shard_dim())};
  return {Shard(param.shard_dim())};
}

// This rank's shard of a managed parameter with its global description: over the FSDP mesh, or for a
// tensor-parallel parameter over the concatenated [fsdp..., tp] mesh with its TP global shape.
ShardedTensor managed_shard(const detail::FSDPParam& param, const detail::MeshInfo& info, const at::Tensor& local) {
  if (const auto& tp = param.tensor_parallel_layout()) {
    return ShardedTensor::from_local(local, tp->mesh, tp->placements, tp->global_shape);
  }
  return ShardedTensor::from_local(local, info.mesh, fsdp_placements(param, info), param.unsharded_sizes());
}

std::vector<int64_t> managed_global_sizes(const detail::FSDPParam& param) {
  if (const auto& tp = param.tensor_parallel_layout()) return tp->global_shape;
  return param.unsharded_sizes();
}

// A parameter not managed by FSDP but tensor-parallel (TP without fully_shard on its module): its TP spec.
std::optional<ShardedTensor> unmanaged_tp_shard(const ModelIndex& index, const at::Tensor& t) {
  auto spec = index.tp_specs.find(t.unsafeGetTensorImpl());
  if (spec == index.tp_specs.end()) return std::nullopt;
  const auto& s = spec->second;
  return ShardedTensor::from_local(t.detach(), s.mesh, s.placements, s.global_shape);
}

// Every parameter (deduplicated: a tied parameter is listed under its first FQN) and buffer of the root.
template <class F>
void for_each_entry(torch::nn::Module& root, F&& f) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) f(item.key(), item.value());
  }
  for (const auto& item : root.named_buffers(/*recurse=*/true)) f(item.key(), item.value());
}

}  // namespace

ShardedStateDict sharded_state_dict(torch::nn::Module& root) {
  ModelIndex index = index_model(root, "sharded_state_dict");
  ShardedStateDict out;
  for_each_entry(root, [&](const std::string& fqn, const at::Tensor& t) {
    auto it = index.managed.find(t.unsafeGetTensorImpl());
    if (it == index.managed.end()) {
      if (auto tp = unmanaged_tp_shard(index, t)) {
        out.emplace(fqn, std::move(*tp));
        return;
      }
      const DeviceMesh& mesh = index.tp_mesh.valid() ? index.tp_mesh : index.any_mesh;
      out.emplace(fqn, ShardedTensor::from_local(index.unmanaged_value(t), mesh, replicated(mesh),
                                                 t.sizes().vec()));
      return;
    }
    const auto& [param, info] = it->second;
    out.emplace(fqn, managed_shard(*param, *info, param->sharded_local().detach()));
  });
  return out;
}

void load_sharded_state_dict(torch::nn::Module& root, const ShardedStateDict& state) {
  ModelIndex index = index_model(root, "load_sharded_state_dict");
  c10::NoGradGuard no_grad;
  std::unordered_set<std::string> used;
  for_each_entry(root, [&](const std::string& fqn, const at::Tensor& t) {
    auto found = state.find(fqn);
    TORCH_CHECK(found != state.end(), "fsdp::load_sharded_state_dict: missing key '", fqn, "'");
    used.insert(fqn);
    const ShardedTensor& src = found->second;
    auto it = index.managed.find(t.unsafeGetTensorImpl());
    const at::Tensor dst = it == index.managed.end() ? t : it->second.first->sharded_local();
    std::vector<int64_t> global = it == index.managed.end() ? t.sizes().vec() : managed_global_sizes(*it->second.first);
    if (it == index.managed.end()) {
      if (auto tp = unmanaged_tp_shard(index, t)) global = tp->sizes();
    }
    TORCH_CHECK(src.sizes() == global, "fsdp::load_sharded_state_dict: '", fqn, "' has global shape ",
                c10::IntArrayRef(src.sizes()), " in the state dict but ", c10::IntArrayRef(global), " in the model");
    TORCH_CHECK(src.local().sizes() == dst.sizes(), "fsdp::load_sharded_state_dict: '", fqn, "' local shard ",
                src.local().sizes(), " does not match this rank's shard ", dst.sizes(),
                " (a different mesh or world size needs checkpoint resharding)");
    dst.copy_(src.local());
  });
  index.invalidate_caches();
  for (const auto& [key, value] : state) {
    TORCH_CHECK(used.count(key), "fsdp::load_sharded_state_dict: unexpected key '", key, "' (not in the model)");
  }
}

FullStateDict full_state_dict(torch::nn::Module& root, const FullStateDictOptions& options) {
  ModelIndex index = index_model(root, "full_state_dict");
  const bool keep = !options.rank0_only || world()->rank() == 0;
  FullStateDict out;
  for_each_entry(root, [&](const std::string& fqn, const at::Tensor& t) {
    auto it = index.managed.find(t.unsafeGetTensorImpl());
    at::Tensor full;
    if (it == index.managed.end()) {
      auto tp = unmanaged_tp_shard(index, t);
      full = tp ? tp->full_tensor() : index.unmanaged_value(t);
    } else {
      const auto& [param, info] = it->second;
      // One parameter at a time: gather, move off the device, drop — the peak is one full parameter.
      full = managed_shard(*param, *info, param->sharded_local().detach().contiguous()).full_tensor();
    }
    if (!keep) return;
    if (options.cpu_offload) full = full.to(c10::kCPU);
    out.emplace(fqn, it == index.managed.end() ? full.clone() : full);
  });
  return out;
}

void load_full_state_dict(torch::nn::Module& root, const FullStateDict& state, bool broadcast_from_rank0) {
  ModelIndex index = index_model(root, "load_full_state_dict");
  c10::NoGradGuard no_grad;
  const bool reader = !broadcast_from_rank0 || world()->rank() == 0;
  std::unordered_set<std::string> used;
  for_each_entry(root, [&](const std::string& fqn, const at::Tensor& t) {
    auto it = index.managed.find(t.unsafeGetTensorImpl());
    std::optional<ShardedTensor> unmanaged_tp = it == index.managed.end() ? unmanaged_tp_shard(index, t) : std::nullopt;
    std::vector<int64_t> global = it == index.managed.end() ? t.sizes().vec() : managed_global_sizes(*it->second.first);
    if (unmanaged_tp) global = unmanaged_tp->sizes();
    at::Tensor full;
    if (reader) {
      auto found = state.find(fqn);
      TORCH_CHECK(found != state.end(), "fsdp::load_full_state_dict: missing key '", fqn, "'");
      used.insert(fqn);
      full = found->second;
      TORCH_CHECK(full.sizes() == c10::IntArrayRef(global), "fsdp::load_full_state_dict: '", fqn, "' has shape ",
                  full.sizes(), " in the state dict but ", c10::IntArrayRef(global), " in the model");
    }
    const at::Tensor dst = it == index.managed.end() ? t : it->second.first->sharded_local();
    if (broadcast_from_rank0) {
      at::Tensor buf = reader ? full.to(dst.device(), dst.scalar_type()).contiguous()
                              : at::empty(global, dst.options());
      world()->broadcast(buf, 0).wait();
      full = buf;
    }
    // This rank's piece of a tensor-parallel parameter: the chunk its layout assigns to this mesh coordinate.
    auto copy_chunk = [&](const ShardedTensor& layout) {
      const auto chunk = compute_local_chunk(layout.sizes(), layout.mesh().shape(), layout.placements(),
                                             layout.mesh().coordinate());
      at::Tensor piece = full;
      for (size_t d = 0; d < chunk.shape.size(); ++d) piece = piece.narrow(d, chunk.offset[d], chunk.shape[d]);
      if (dst.numel() > 0) dst.copy_(piece);
    };
    if (it == index.managed.end()) {
      if (unmanaged_tp) {
        copy_chunk(*unmanaged_tp);
      } else {
        dst.copy_(full);
      }
      return;
    }
    const detail::FSDPParam& p = *it->second.first;
    if (p.tensor_parallel_layout()) {
      copy_chunk(managed_shard(p, *it->second.second, dst));
      return;
    }
    if (dst.numel() > 0) dst.copy_(p.local_part_of(full));
  });
  index.invalidate_caches();
  if (reader) {
    for (const auto& [key, value] : state) {
      TORCH_CHECK(used.count(key), "fsdp::load_full_state_dict: unexpected key '", key, "' (not in the model)");
    }
  }
}

}  // namespace fsdp
