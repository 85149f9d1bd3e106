// fsdp::fully_shard and the FSDPModule handle (Python's _fully_shard.py).
#include <fsdp/fully_shard.h>

#include "fully_shard/fsdp_state.h"
#include "fully_shard/mesh_cache.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <unordered_set>

namespace fsdp {
namespace {

// The default mesh: 1-D over the world, created on the first fully_shard call that needs it.
DeviceMesh default_world_mesh() {
  return detail::cached_mesh("default", [] {
    auto world_group = world();
    const std::string type = world_group->device().is_cuda() ? "cuda" : world_group->device().str();
    return init_device_mesh(type, {world_group->size()}, {"shard"});
  });
}

detail::MeshInfo make_mesh_info(const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2, "fully_shard: expects a 1-D (FSDP) or 2-D (HSDP: replicate, shard) ",
              "mesh, got ", mesh.to_string());
  detail::MeshInfo info;
  info.mesh = mesh;
  info.shard_group = mesh.group(mesh.ndim() - 1);
  info.shard_rank = info.shard_group->rank();
  info.shard_size = info.shard_group->size();
  if (mesh.ndim() == 2) {
    info.replicate_group = mesh.group(0);
    info.replicate_size = info.replicate_group->size();
  }
  if (mesh.device_type() == c10::kCUDA) {
    info.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env_local_rank()));
  } else {
    info.device = c10::Device(mesh.device_type());
  }
  return info;
}

}  // namespace

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: no module given");
  for (const auto& m : modules) {
    TORCH_CHECK(m != nullptr, "fully_shard: null module");
    TORCH_CHECK(!detail::find_state(*m), "fully_shard: module ", m->name(), " is already sharded (fully_shard was "
                "applied to it before)");
  }
  for (const auto& m : modules) detail::check_container_dispatch(*m);  // torch::nn::Sequential with sharded elements
  FullyShardOptions opts = options;
  if (!opts.mesh.valid()) opts.mesh = default_world_mesh();
  detail::MeshInfo mesh_info = make_mesh_info(opts.mesh);

  // Parameters already managed by FSDP states below (children sharded first, bottom-up) or ignored stay
  // out of this group; shared (tied) parameters are managed once.
  std::unordered_set<const c10::TensorImpl*> excluded;
  for (const auto& t : opts.ignored_params) excluded.insert(t.unsafeGetTensorImpl());
  for (const auto& m : modules) {
    for (const auto& sub : m->modules(/*include_self=*/false)) {
      if (auto s = detail::find_state(*sub); s && s->param_group()) {
        for (auto* p : s->param_group()->params()) excluded.insert(p->param().unsafeGetTensorImpl());
      }
    }
  }
  std::vector<std::unique_ptr<detail::FSDPParam>> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (const auto& item : modules[mi]->named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (excluded.count(impl) || !seen.insert(impl).second) continue;
      params.push_back(std::make_unique<detail::FSDPParam>(p, prefix + item.key(), mesh_info.shard_rank,
                                                           mesh_info.shard_size, mesh_info.device, opts.mp_policy,
                                                           opts.offload_policy));
    }
    // Buffers are not sharded; like PyTorch, FSDP moves them to the mesh's device.
    c10::NoGradGuard no_grad;
    for (auto& buffer : modules[mi]->buffers(/*recurse=*/true)) {
      if (!buffer.is_meta() && buffer.device() != mesh_info.device) buffer.set_data(buffer.to(mesh_info.device));
    }
  }
  std::unique_ptr<detail::FSDPParamGroup> group;
  if (!params.empty()) group = std::make_unique<detail::FSDPParamGroup>(std::move(params), mesh_info, opts);

  std::vector<std::weak_ptr<torch::nn::Module>> weak_modules(modules.begin(), modules.end());
  auto state = std::make_shared<FSDPState>(std::move(weak_modules), std::move(group), opts);
  // States below (sharded first, bottom-up) must not run forward before this one: FSDP initializes from the root.
  for (const auto& m : modules) {
    for (const auto& sub : m->modules(/*include_self=*/false)) {
      if (auto s = detail::find_state(*sub)) s->set_has_fsdp_ancestor(state->name());
    }
  }
  if (state->param_group()) state->param_group()->set_name(state->name());
  state->attach();
  for (const auto& m : modules) {
    auto holder = std::make_shared<detail::FSDPStateHolder>();
    holder->state = state;
    m->register_module(detail::kStateHolderName, holder);
  }
  return FSDPModule(state);
}

std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module) {
  if (auto s = detail::find_state(module)) return FSDPModule(s);
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------------------
// FSDPModule

namespace {
FSDPState& state_of(const FSDPModule& m) { return detail::FSDPModuleAccess::state(m); }
}  // namespace

torch::nn::Module& FSDPModule::module() const { return state_of(*this).module(); }

void FSDPModule::reset() { state_of(*this).reset(); }

UnshardHandle FSDPModule::unshard(bool async_op) {
  state_of(*this).unshard(async_op);
  return UnshardHandle(state_);
}

void UnshardHandle::wait() {
  if (auto s = state_.lock()) s->wait_for_unshard();
}

void FSDPModule::reshard() { state_of(*this).reshard(); }

namespace {
template <class F>
void for_states(FSDPState& state, bool recurse, F&& f) {
  if (!recurse) {
    f(state);
    return;
  }
  for (auto& s : state.subtree_states()) f(*s);
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool requires_sync, bool recurse) {
  for_states(state_of(*this), recurse, [&](FSDPState& s) {
    if (s.param_group()) s.param_group()->requires_gradient_sync = requires_sync;
  });
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for_states(state_of(*this), recurse, [&](FSDPState& s) {
    if (s.param_group()) s.param_group()->requires_all_reduce = requires_all_reduce;
  });
}

void FSDPModule::set_reshard_after_forward(ReshardAfterForward value, bool recurse) {
  for_states(state_of(*this), recurse, [&](FSDPState& s) {
    if (s.param_group()) s.param_group()->set_reshard_after_forward(value);
  });
}

void FSDPModule::set_reshard_after_backward(bool value, bool recurse) {
  for_states(state_of(*this), recurse, [&](FSDPState& s) {
    if (s.param_group()) s.param_group()->reshard_after_backward = value;
  });
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state_of(*this).forward_prefetch.clear();
  for (const auto& m : modules) state_of(*this).forward_prefetch.push_back(m.state_);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state_of(*this).backward_prefetch.clear();
  for (const auto& m : modules) state_of(*this).backward_prefetch.push_back(m.state_);
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0, "fsdp: gradient divide factor must be positive, got ", factor);
  if (state_of(*this).param_group()) state_of(*this).param_group()->gradient_divide_factor = factor;
}


}  // namespace fsdp
