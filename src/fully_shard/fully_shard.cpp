// fsdp::fully_shard and the FSDPModule handle (Python's _fully_shard.py).
#include <fsdp/fully_shard.h>
#include <fsdp/fully_shard_extensions.h>

#include "fully_shard/fsdp_state.h"
#include "fully_shard/mesh_cache.h"
#include "tensor/param_spec.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
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
    // The group's own device, chosen once at init_process_group (LOCAL_RANK by default, or
    // InitOptions.device, e.g. every rank on cuda:0 of a one-GPU machine).
    info.device = info.shard_group->device();
  } else {
    info.device = c10::Device(mesh.device_type());
  }
  return info;
}

// Which FSDP state manages each sharded parameter, over every fully_shard call of the process: a parameter
// shared by modules sharded in separate calls (tied weights) must be caught at the second call — its data
// already shows the first group's shard, so a second group would shard the shard. Entries whose parameter or
// state is gone are skipped and purged.
struct ParamOwner {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  std::weak_ptr<FSDPState> state;
  std::string fqn;  // within the owner's module(s)
};

class ParamOwners {
 public:
  // The live owner of `param`, or nullptr.
  const ParamOwner* find(const at::Tensor& param) {
    auto it = owners_.find(param.unsafeGetTensorImpl());
    if (it == owners_.end() || !alive(it->second)) return nullptr;
    return &it->second;
  }
  void add(const at::Tensor& param, const std::shared_ptr<FSDPState>& state, std::string fqn) {
    owners_.insert_or_assign(param.unsafeGetTensorImpl(),
                             ParamOwner{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), state,
                                        std::move(fqn)});
  }
  void purge() {
    for (auto it = owners_.begin(); it != owners_.end();) it = alive(it->second) ? std::next(it) : owners_.erase(it);
  }

 private:
  static bool alive(const ParamOwner& o) { return !o.param.expired() && !o.state.expired(); }
  std::unordered_map<const c10::TensorImpl*, ParamOwner> owners_;
};

ParamOwners& param_owners() {
  static ParamOwners owners;
  return owners;
}
std::mutex& param_owners_mutex() {
  static std::mutex m;
  return m;
}

std::string module_list(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::string out;
  for (const auto& m : modules) out += (out.empty() ? "" : ", ") + m->name();
  return modules.size() > 1 ? "{" + out + "}" : out;
}

// The parameters of one fully_shard call that shard over one mesh: they become one FSDPParamGroup.
struct MeshBucket {
  DeviceMesh mesh;
  std::string identity;  // detail::mesh_identity(mesh)
  std::vector<size_t> params;  // indices into the call's parameters to shard
};

// A mesh that shard_placement_fn chose for `fqn`: one FSDPParamGroup can use it, beside the call's mesh.
void check_param_mesh(const DeviceMesh& mesh, const FullyShardOptions& opts, const std::string& fqn,
                      const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  TORCH_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2, "fully_shard(", module_list(modules), "): shard_placement_fn "
              "put parameter '", fqn, "' on ", mesh.to_string(), ", but a parameter's mesh must be 1-D (FSDP) or "
              "2-D (HSDP: replicate, shard)");
  TORCH_CHECK(mesh.device_type() == opts.mesh.device_type(), "fully_shard(", module_list(modules),
              "): shard_placement_fn put parameter '", fqn, "' on ", mesh.to_string(), ", but the call's mesh is ",
              opts.mesh.to_string(), ": the parameters of one call compute on one device type");
  if (opts.reshard_after_forward) {
    if (const int* n = std::get_if<int>(&*opts.reshard_after_forward)) {
      const int64_t shard = mesh.size(mesh.ndim() - 1);
      TORCH_CHECK(*n >= 1 && shard % *n == 0, "fully_shard(", module_list(modules), "): reshard_after_forward=", *n,
                  " must be a positive divisor of the shard group size of every mesh of the call, but parameter '",
                  fqn, "' is on ", mesh.to_string(), " whose shard dim has ", shard, " ranks");
    }
  }
}

// The bucket of `mesh`, added after the others if new. Meshes are the same when their device type, shape,
// dim names and ranks here are, and so is their identity (the root layout: then they are the same on every
// rank too, so every rank builds the same groups in the same order).
MeshBucket& bucket_of(std::vector<MeshBucket>& buckets, const DeviceMesh& mesh) {
  const std::string identity = detail::mesh_identity(mesh);
  for (auto& b : buckets) {
    if (b.identity == identity && b.mesh.device_type() == mesh.device_type() && b.mesh.shape() == mesh.shape() &&
        b.mesh.dim_names() == mesh.dim_names() && b.mesh.ranks() == mesh.ranks()) {
      return b;
    }
  }
  buckets.push_back(MeshBucket{mesh, identity, {}});
  return buckets.back();
}

// fully_shard's phases, in the order it runs them (PyTorch's fully_shard.py likewise splits them into
// _get_managed_modules / _get_managed_states / _move_states_to_device / FSDPParamGroup construction).
using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;

// Non-null modules, none sharded before; Sequential containers dispatch to sharded elements correctly.
void check_modules(const Modules& modules) {
  TORCH_CHECK(!modules.empty(), "fully_shard: no module given");
  for (const auto& m : modules) {
    TORCH_CHECK(m != nullptr, "fully_shard: null module");
    TORCH_CHECK(!detail::find_state(*m), "fully_shard: module ", m->name(), " is already sharded (fully_shard was "
                "applied to it before)");
  }
  for (const auto& m : modules) detail::check_container_dispatch(*m);  // torch::nn::Sequential with sharded elements
}

// What this call must leave alone.
struct Exclusions {
  std::unordered_set<const c10::TensorImpl*> params;        // ignored, or managed by a state below
  std::unordered_set<const c10::TensorImpl*> buffers_done;  // cast by a state below (its own buffer_dtype)
};

// Parameters already managed by FSDP states below (children sharded first, bottom-up) or ignored stay out of
// this group; shared (tied) parameters are managed once (choose_params). Sharded submodules keep their own
// ignored parameters out of this group too (PyTorch's managed-module walk stops at sharded submodules), and
// their buffers under their own buffer_dtype.
Exclusions collect_exclusions(const Modules& modules, const FullyShardOptions& opts) {
  Exclusions out;
  for (const auto& t : opts.ignored_params) out.params.insert(t.unsafeGetTensorImpl());
  for (const auto& m : modules) {
    for (const auto& sub : m->modules(/*include_self=*/false)) {
      auto s = detail::find_state(*sub);
      if (!s) continue;
      for (auto* g : s->param_groups()) {
        for (auto* p : g->params()) out.params.insert(p->param().unsafeGetTensorImpl());
      }
      for (const auto& t : s->options().ignored_params) out.params.insert(t.unsafeGetTensorImpl());
      for (const auto& [buffer, dtype] : s->cast_buffers) out.buffers_done.insert(buffer.unsafeGetTensorImpl());
    }
  }
  return out;
}

// A parameter this call shards: its name within the call, the dim and the mesh it shards over.
struct ChosenParam {
  std::string fqn;
  at::Tensor param;
  int64_t shard_dim = 0;
  DeviceMesh mesh;
};

// The parameters to shard, in named_parameters order, with their placement (shard_placement_fn, else dim 0 of
// the call's mesh). Validates only: a refused call leaves every parameter as it was. A parameter another
// call's group manages (a tied weight sharded separately) is refused here.
std::vector<ChosenParam> choose_params(const Modules& modules, const FullyShardOptions& opts,
                                       const Exclusions& exclusions) {
  std::vector<ChosenParam> chosen_params;
  std::unordered_set<const c10::TensorImpl*> seen;
  std::lock_guard<std::mutex> lock(param_owners_mutex());
  param_owners().purge();
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (const auto& item : modules[mi]->named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (exclusions.params.count(impl) || !seen.insert(impl).second) continue;
      if (const ParamOwner* owner = param_owners().find(p)) {
        const std::string other = owner->state.lock()->name();
        TORCH_CHECK(false, "fully_shard(", module_list(modules), "): parameter '", prefix + item.key(),
                    "' is already managed by the FSDP parameter group of ", other, " (as '", owner->fqn,
                    "'): a shared (tied) parameter can belong to only one group. Shard the modules that share it "
                    "in one call — fully_shard({", other, ", ", modules[mi]->name(), "}) in C++ terms: "
                    "fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{a, b}, options) — or do not "
                    "shard them separately and let their common parent's fully_shard own it. (If ", other,
                    " is an ancestor of this module, apply fully_shard bottom-up: submodules first.)");
      }
      ChosenParam chosen_param{prefix + item.key(), p, 0, opts.mesh};
      if (opts.shard_placement_fn) {
        std::optional<ShardPlacement> chosen = opts.shard_placement_fn(p);
        if (chosen) {
          const int64_t ndim = p.dim();
          TORCH_CHECK(ndim > 0 ? (chosen->dim >= -ndim && chosen->dim < ndim) : chosen->dim == 0, "fully_shard: "
                      "shard_placement_fn chose dim ", chosen->dim, " for parameter '", chosen_param.fqn,
                      "' of shape ", p.sizes(), ", which has no such dim");
          chosen_param.shard_dim = chosen->dim;
          if (chosen->mesh.valid()) {
            chosen_param.mesh = chosen->mesh;
            check_param_mesh(chosen_param.mesh, opts, chosen_param.fqn, modules);
          }
        }
      }
      chosen_params.push_back(std::move(chosen_param));
    }
  }
  return chosen_params;
}

// One bucket per mesh: the call's mesh first (even when empty), then the meshes shard_placement_fn chose, in
// order of first use.
std::vector<MeshBucket> bucket_by_mesh(const std::vector<ChosenParam>& chosen_params, const DeviceMesh& call_mesh) {
  std::vector<MeshBucket> buckets;
  bucket_of(buckets, call_mesh);
  for (size_t i = 0; i < chosen_params.size(); ++i) bucket_of(buckets, chosen_params[i].mesh).params.push_back(i);
  return buckets;
}

// One FSDPParamGroup per non-empty bucket. Tensor-parallel parameters (parallelize_module ran first): FSDP
// shards their local TP piece.
std::vector<std::unique_ptr<detail::FSDPParamGroup>> build_groups(const Modules& modules,
                                                                  const std::vector<ChosenParam>& chosen_params,
                                                                  const std::vector<MeshBucket>& buckets,
                                                                  const detail::MeshInfo& call_mesh_info,
                                                                  const FullyShardOptions& opts) {
  std::unordered_map<const c10::TensorImpl*, TensorParallelSpec> tp_specs;
  for (const auto& m : modules) tp_specs.merge(tp::collect_specs(*m));
  std::vector<std::unique_ptr<detail::FSDPParamGroup>> groups;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const MeshBucket& bucket = buckets[b];
    if (bucket.params.empty()) continue;  // e.g. every parameter went to another mesh
    const detail::MeshInfo info = b == 0 ? call_mesh_info : make_mesh_info(bucket.mesh);
    std::vector<std::unique_ptr<detail::FSDPParam>> params;
    for (size_t i : bucket.params) {
      const ChosenParam& chosen = chosen_params[i];
      std::shared_ptr<const AllGatherTransform> transform =
          opts.all_gather_transform_fn ? opts.all_gather_transform_fn(chosen.param) : nullptr;
      params.push_back(std::make_unique<detail::FSDPParam>(chosen.param, chosen.fqn, info.shard_rank,
                                                           info.shard_size, info.device, opts.mp_policy,
                                                           opts.offload_policy, chosen.shard_dim, std::move(transform)));
      auto tp = tp_specs.find(chosen.param.unsafeGetTensorImpl());
      if (tp != tp_specs.end()) params.back()->set_tensor_parallel(tp->second, bucket.mesh);
    }
    groups.push_back(std::make_unique<detail::FSDPParamGroup>(std::move(params), info, opts));
  }
  return groups;
}

// Buffers are not sharded; like PyTorch, FSDP moves them to the mesh's device (and, with buffer_dtype, keeps
// the floating-point ones of this call in that dtype). Returns the cast buffers with their original dtypes.
std::vector<std::pair<at::Tensor, c10::ScalarType>> move_and_cast_buffers(
    const Modules& modules, const detail::MeshInfo& mesh_info, const FullyShardOptions& opts,
    std::unordered_set<const c10::TensorImpl*> buffers_done) {
  std::vector<std::pair<at::Tensor, c10::ScalarType>> cast_buffers;
  c10::NoGradGuard no_grad;
  const auto buffer_dtype = opts.mp_policy.buffer_dtype;
  for (const auto& m : modules) {
    for (auto& buffer : m->buffers(/*recurse=*/true)) {
      if (buffer.is_meta()) continue;
      if (buffer.device() != mesh_info.device) buffer.set_data(buffer.to(mesh_info.device));
      if (!buffer_dtype || !at::isFloatingType(buffer.scalar_type()) || buffers_done.count(buffer.unsafeGetTensorImpl())) {
        continue;
      }
      if (!buffers_done.insert(buffer.unsafeGetTensorImpl()).second) continue;  // shared by two members
      cast_buffers.emplace_back(buffer, buffer.scalar_type());
      if (buffer.scalar_type() != *buffer_dtype) buffer.set_data(buffer.to(*buffer_dtype));
    }
  }
  return cast_buffers;
}

// The state over the groups: its parameters recorded as owned (for later calls' tied-weight check), the states
// below told they have an ancestor, its hooks installed, and each module given its holder.
FSDPModule attach_state(const Modules& modules, std::vector<std::unique_ptr<detail::FSDPParamGroup>> groups,
                        const FullyShardOptions& opts,
                        std::vector<std::pair<at::Tensor, c10::ScalarType>> cast_buffers) {
  std::vector<std::weak_ptr<torch::nn::Module>> weak_modules(modules.begin(), modules.end());
  auto state = std::make_shared<FSDPState>(std::move(weak_modules), std::move(groups), opts);
  state->cast_buffers = std::move(cast_buffers);
  {
    std::lock_guard<std::mutex> lock(param_owners_mutex());
    for (auto* g : state->param_groups()) {
      for (auto* p : g->params()) param_owners().add(p->param(), state, p->fqn());
    }
  }
  // States below (sharded first, bottom-up) must not run forward before this one: FSDP initializes from the root.
  for (const auto& m : modules) {
    for (const auto& sub : m->modules(/*include_self=*/false)) {
      if (auto s = detail::find_state(*sub)) s->set_has_fsdp_ancestor(state->name());
    }
  }
  state->attach();
  for (const auto& m : modules) {
    auto holder = std::make_shared<detail::FSDPStateHolder>();
    holder->state = state;
    m->register_module(detail::kStateHolderName, holder);
  }
  return FSDPModule(state);
}

}  // namespace

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  check_modules(modules);
  FullyShardOptions opts = options;
  if (!opts.mesh.valid()) opts.mesh = default_world_mesh();
  const detail::MeshInfo mesh_info = make_mesh_info(opts.mesh);
  Exclusions exclusions = collect_exclusions(modules, opts);
  // Validate before changing anything: a refused call leaves every parameter as it was.
  const std::vector<ChosenParam> chosen_params = choose_params(modules, opts, exclusions);
  const std::vector<MeshBucket> buckets = bucket_by_mesh(chosen_params, opts.mesh);
  auto groups = build_groups(modules, chosen_params, buckets, mesh_info, opts);
  auto cast_buffers = move_and_cast_buffers(modules, mesh_info, opts, std::move(exclusions.buffers_done));
  return attach_state(modules, std::move(groups), opts, std::move(cast_buffers));
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

void FSDPModule::set_is_last_backward(bool is_last_backward) { state_of(*this).set_is_last_backward(is_last_backward); }

void FSDPModule::post_backward() { state_of(*this).explicit_post_backward(); }

namespace {
// f(group) for every parameter group (one per mesh) of the state, and with recurse of every state below it.
template <class F>
void for_groups(FSDPState& state, bool recurse, F&& f) {
  if (!recurse) {
    for (auto* g : state.param_groups()) f(*g);
    return;
  }
  for (auto& s : state.subtree_states()) {
    for (auto* g : s->param_groups()) f(*g);
  }
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool requires_sync, bool recurse) {
  for_groups(state_of(*this), recurse, [&](detail::FSDPParamGroup& g) { g.requires_gradient_sync = requires_sync; });
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for_groups(state_of(*this), recurse, [&](detail::FSDPParamGroup& g) { g.requires_all_reduce = requires_all_reduce; });
}

void FSDPModule::set_reshard_after_forward(ReshardAfterForward value, bool recurse) {
  for_groups(state_of(*this), recurse, [&](detail::FSDPParamGroup& g) { g.set_reshard_after_forward(value); });
}

void FSDPModule::set_reshard_after_backward(bool value, bool recurse) {
  for_groups(state_of(*this), recurse, [&](detail::FSDPParamGroup& g) { g.reshard_after_backward = value; });
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state_of(*this).forward_prefetch.clear();
  for (const auto& m : modules) state_of(*this).forward_prefetch.push_back(m.state_);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state_of(*this).backward_prefetch.clear();
  for (const auto& m : modules) state_of(*this).backward_prefetch.push_back(m.state_);
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  for_groups(state_of(*this), /*recurse=*/false,
             [&](detail::FSDPParamGroup& g) { g.unshard_in_backward = unshard_in_backward; });
}

namespace {
// A custom collective sees one group's flat buffer: refused on a module with several groups, as PyTorch does.
detail::FSDPParamGroup* single_group(FSDPState& state, const char* what) {
  TORCH_CHECK(state.param_groups().size() <= 1, "fsdp: ", what, " on FSDP module ", state.name(), ", whose parameters "
              "shard over ", state.param_groups().size(), " meshes (one parameter group each, from shard_placement_fn): "
              "a custom collective needs a module with a single parameter group. Shard the parameters on the other mesh "
              "in a separate fully_shard call on their submodule and set it on each");
  return state.param_group();
}
}  // namespace

void FSDPModule::set_custom_all_gather(std::shared_ptr<FSDPAllGather> comm) {
  if (auto* g = single_group(state_of(*this), "set_custom_all_gather")) g->set_custom_all_gather(std::move(comm));
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<FSDPReduceScatter> comm) {
  if (auto* g = single_group(state_of(*this), "set_custom_reduce_scatter")) g->set_custom_reduce_scatter(std::move(comm));
}

void FSDPModule::set_all_reduce_hook(AllReduceHook hook) {
  FSDPState& state = state_of(*this);
  // One hook sees one group's flat reduce output; with several meshes there are several outputs, of different
  // layouts and reduced over different ranks (PyTorch refuses it too: "not supported with multiple param groups").
  TORCH_CHECK(state.param_groups().size() <= 1, "fsdp: set_all_reduce_hook on FSDP module ", state.name(),
              ", whose parameters shard over ", state.param_groups().size(), " meshes (one parameter group each, "
              "from shard_placement_fn): an all-reduce hook needs a module with a single parameter group. Shard the "
              "parameters on the other mesh in a separate fully_shard call on their submodule and set the hook on each");
  for (auto* g : state.param_groups()) g->all_reduce_hook = std::move(hook);
}

void FSDPModule::set_force_sum_reduction_for_comms(bool enable, bool recurse) {
  for_groups(state_of(*this), recurse, [&](detail::FSDPParamGroup& g) { g.force_sum_reduction_for_comms = enable; });
}

void FSDPModule::set_post_optim_event(c10::Event event) { state_of(*this).set_post_optim_event(std::move(event)); }

void FSDPModule::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0, "fsdp: gradient divide factor must be positive, got ", factor);
  for_groups(state_of(*this), /*recurse=*/false, [&](detail::FSDPParamGroup& g) { g.gradient_divide_factor = factor; });
}


}  // namespace fsdp
