// param_group_layouts (fsdp/fully_shard_layout.h): the groups' own geometry and all-gather layout, as they are.
#include "fully_shard/fsdp_collectives.h"
#include "fully_shard/fsdp_param.h"
#include "fully_shard/fsdp_param_group.h"
#include "fully_shard/fsdp_state.h"

#include <fsdp/fully_shard_layout.h>

namespace fsdp {

std::vector<ParamGroupLayout> param_group_layouts(const FSDPModule& module) {
  std::vector<ParamGroupLayout> out;
  for (const detail::FSDPParamGroup* group : detail::FSDPModuleAccess::state(module).param_groups()) {
    const detail::MeshInfo& info = group->mesh_info();
    ParamGroupLayout g;
    g.mesh = info.mesh;
    g.shard_size = info.shard_size;
    g.replicate_size = info.replicate_size;
    // The slot as the group packs it for its all-gather (alignment and transforms included).
    const detail::AllGatherLayout layout = detail::make_all_gather_layout(group->params());
    g.all_gather_bytes = layout.per_rank_bytes;
    for (size_t i = 0; i < group->params().size(); ++i) {
      const detail::FSDPParam& p = *group->params()[i];
      ShardedParamLayout l;
      l.fqn = p.fqn();
      l.unsharded_sizes = p.unsharded_sizes();
      l.shard_dim = p.shard_dim();
      l.padded_shard_numel = p.geometry().padded_numel();
      l.local_numel = p.geometry().rows_of(p.shard_rank()) * p.geometry().row_numel;
      l.param_dtype = p.param_dtype();
      l.reduce_dtype = p.reduce_dtype();
      const int64_t next = i + 1 < group->params().size() ? layout.byte_offsets[i + 1] : layout.per_rank_bytes;
      l.all_gather_bytes = next - layout.byte_offsets[i];
      if (const auto& tp = p.tensor_parallel_layout()) {
        l.global_sizes = tp->global_shape;
        l.global_placements = tp->placements;
      }
      g.params.push_back(std::move(l));
    }
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace fsdp
