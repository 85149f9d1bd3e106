// FSDPStateHolder::to: module->to(dtype / device) on a module that fully_shard was applied to.
#include "fully_shard/fsdp_state.h"
#include "fully_shard/state_holder.h"

namespace fsdp::detail {
namespace {

void check_device(const FSDPState& state, torch::Device device) {
  const auto& groups = state.param_groups();
  if (groups.empty()) return;
  // Every group of a state computes on one device type (fully_shard checks the meshes).
  const c10::Device mesh_device = groups.front()->mesh_info().device;
  const bool same = device.type() == mesh_device.type() && (!device.has_index() || device == mesh_device);
  if (same) return;
  // Parameters in child modules visited before this holder were re-pointed to copies on `device`: show the
  // shards again, so that the rejected call leaves FSDP's parameters as they were.
  for (const detail::FSDPParamGroup* group : groups) {
    for (FSDPParam* p : group->params()) {
      if (!p->param().is_alias_of(p->sharded_local())) p->param().set_data(p->sharded_local());
    }
  }
  TORCH_CHECK(false, "fsdp: module->to(", device, ") on FSDP module ", state.name(), " whose mesh is on ", mesh_device,
              ": FSDP keeps shards and gathered parameters on the mesh's device. Move the model before fully_shard "
              "(or build it on meta and materialize on the target device); FSDP's parameters were left unchanged, "
              "tensors it does not manage may have moved");
}

}  // namespace

void FSDPStateHolder::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (!state) return;
  check_device(*state, device);
  state->convert_dtype(dtype);
}

void FSDPStateHolder::to(torch::Dtype dtype, bool non_blocking) {
  if (state) state->convert_dtype(dtype);
}

void FSDPStateHolder::to(torch::Device device, bool non_blocking) {
  if (state) check_device(*state, device);
}

}  // namespace fsdp::detail
