// See parallelize.h.
#include "parallelize.h"

#include <ATen/Context.h>

namespace fsdp_train {

fsdp::pipeline::ScheduleKind schedule_kind(PipelineSchedule schedule) {
  using K = fsdp::pipeline::ScheduleKind;
  switch (schedule) {
    case PipelineSchedule::GPipe: return K::GPipe;
    case PipelineSchedule::OneFOneB: return K::OneFOneB;
    case PipelineSchedule::LoopedBFS: return K::LoopedBFS;
    case PipelineSchedule::Interleaved1F1B: return K::Interleaved1F1B;
    case PipelineSchedule::InterleavedZeroBubble: return K::InterleavedZeroBubble;
    case PipelineSchedule::ZBVZeroBubble: return K::ZBVZeroBubble;
    case PipelineSchedule::DualPipeV: return K::DualPipeV;
  }
  return K::OneFOneB;  // unreachable: every enumerator is handled above
}

bool plain_data_parallel(const ParallelDims& dims) {
  return dims.tp == 1 && dims.cp == 1 && dims.dp_shard == 1 && dims.dp_replicate > 1;
}

c10::Device mesh_device(const JobConfig& config) {
  const c10::Device device(config.training.device);  // the form was checked by validate()
  if (device.is_cuda() && !at::hasCUDA()) {
    throw ConfigError("training.device = \"" + config.training.device +
                      "\": CUDA is not available in this process (a CPU build of libtorch, or no GPU visible); "
                      "use \"cpu\"");
  }
  return device;
}

bool plan_uses_fully_shard(const ParallelDims& dims, bool has_group) {
  // Plain data parallelism is fully_shard too: fsdp::replicate over a (dp_replicate, 1) mesh.
  return has_group;
}

bool plan_needs_full_init(const ParallelDims& dims, bool has_group) {
  // Replicas are built whole, then replicate broadcasts replica 0's weights (DDP's guarantee); TP plans need
  // the whole model before they split it.
  return !has_group || plain_data_parallel(dims) || dims.tp > 1 || dims.ep > 1;
}

ParallelMeshes build_meshes(const ParallelDims& dims, const std::string& device_type, bool moe) {
  // TorchTitan's order: pp, dp_replicate, dp_shard, cp, tp (pp outermost; TP innermost: contiguous ranks).
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  auto add = [&](int64_t size, const char* name) {
    shape.push_back(size);
    names.emplace_back(name);
  };
  if (dims.pp > 1) add(dims.pp, "pp");
  if (dims.dp_replicate > 1) add(dims.dp_replicate, "dp_replicate");
  add(dims.dp_shard, "dp_shard");
  if (dims.cp > 1) add(dims.cp, "cp");
  if (dims.tp > 1) add(dims.tp, "tp");
  ParallelMeshes m;
  m.world = fsdp::init_device_mesh(device_type, shape, names);
  const bool only_dp = dims.pp == 1 && dims.tp == 1 && dims.cp == 1;  // the world mesh is the data-parallel mesh
  m.dp = only_dp ? m.world : dims.dp_replicate > 1 ? m.world.slice({"dp_replicate", "dp_shard"}) : m.world["dp_shard"];
  if (dims.tp > 1) m.tp = m.world["tp"];
  if (dims.cp > 1) {
    // FSDP shards over dp_shard x cp (TorchTitan's flattened dp_shard_cp): every cp rank holds different tokens, so
    // the gradients reduce over cp too. dp_shard and cp are neighbours in the world mesh, so the same ranks in the
    // same row-major order with the two dims merged are that flattening (a second mesh over the same ranks).
    m.cp = m.world["cp"];
    std::vector<int64_t> dense_shape;
    std::vector<std::string> dense_names;
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "dp_shard") continue;
      dense_shape.push_back(names[i] == "cp" ? dims.dp_shard * dims.cp : shape[i]);
      dense_names.push_back(names[i] == "cp" ? "dp_shard_cp" : names[i]);
    }
    const fsdp::DeviceMesh dense = fsdp::init_device_mesh(device_type, dense_shape, dense_names);
    m.dp = dims.dp_replicate > 1 ? dense.slice({"dp_replicate", "dp_shard_cp"}) : dense["dp_shard_cp"];
    // fully_shard joins a TP parameter's mesh with the data-parallel one: both must be dims of one mesh.
    if (dims.tp > 1) m.tp = dense["tp"];
  }
  if (dims.ep > 1 || (moe && dims.tp > 1)) {
    // TorchTitan's sparse mesh over the same ranks: [dp_replicate,] efsdp, ep with efsdp x ep = dp_shard x cp x tp
    // (expert parallelism borrows its ranks from FSDP's shard dim, CP and TP; the experts' FSDP takes the rest;
    // the three are neighbours in the world mesh). With TP each TP rank routes its own tokens, so the routed
    // experts' FSDP spans the TP ranks even without EP.
    std::vector<int64_t> sparse_shape{dims.efsdp()};
    std::vector<std::string> sparse_names{"efsdp"};
    if (dims.ep > 1) {
      sparse_shape.push_back(dims.ep);
      sparse_names.emplace_back("ep");
    }
    if (dims.dp_replicate > 1) {
      sparse_shape.insert(sparse_shape.begin(), dims.dp_replicate);
      sparse_names.insert(sparse_names.begin(), "dp_replicate");
    }
    if (dims.pp > 1) {  // inside each pipeline stage's ranks (pp outermost, as in the world mesh)
      sparse_shape.insert(sparse_shape.begin(), dims.pp);
      sparse_names.insert(sparse_names.begin(), "pp");
    }
    const fsdp::DeviceMesh sparse = fsdp::init_device_mesh(device_type, sparse_shape, sparse_names);
    if (dims.ep > 1) m.ep = sparse["ep"];
    m.expert_dp = dims.dp_replicate > 1 ? sparse.slice({"dp_replicate", "efsdp"})
                  : sparse_names.size() == 1 ? sparse
                                             : sparse["efsdp"];
  }
  return m;
}

PipelineSplitOptions pipeline_split_options(const JobConfig& config, const ParallelDims& dims) {
  const auto& p = config.parallelism;
  PipelineSplitOptions so;
  so.schedule = p.pipeline_parallel_schedule;
  so.pp = dims.pp;
  so.microbatches = dims.pp_microbatches;
  so.layers_per_stage = p.pipeline_parallel_layers_per_stage;
  so.first_stage_less_layers = p.pipeline_parallel_first_stage_less_layers;
  so.last_stage_less_layers = p.pipeline_parallel_last_stage_less_layers;
  so.module_fqns_per_model_part = p.module_fqns_per_model_part;
  so.schedule_csv = p.pipeline_parallel_schedule_csv;
  return so;
}

}  // namespace fsdp_train
