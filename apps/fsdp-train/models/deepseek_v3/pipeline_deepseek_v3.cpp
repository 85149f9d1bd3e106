// See pipeline_deepseek_v3.h.
#include "pipeline_deepseek_v3.h"

#include "models/llama3/parallelize_llama.h"
#include "parallelize_deepseek_v3.h"

#include <fsdp/expert_parallel.h>
#include <fsdp/models/deepseek_v3_pipeline.h>
#include <fsdp/models/moe.h>

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace fsdp_train::deepseek_v3 {

namespace ds = fsdp::models::deepseek_v3;

PipelineSplit split_pipeline(const ds::DeepSeekV3Args& args, const PipelineSplitOptions& options) {
  // The split only sees the chain of modules, which is the untied Llama decoder's: its layer count is all it takes.
  fsdp::models::llama::LlamaArgs chain;
  chain.n_layers = args.n_layers;
  chain.tie_embeddings = false;
  return llama3::split_pipeline(chain, options);
}

ParallelPlan parallelize_deepseek_v3_pipeline(ds::DeepSeekV3& model, const JobConfig& config,
                                              const ParallelDims& dims, const fsdp::ProcessGroupPtr& group,
                                              ParallelPlan plan) {
  TORCH_CHECK(group, "pipeline parallelism needs a process group (run under fsdprun)");
  const ParallelMeshes meshes = build_meshes(dims, mesh_device(config).is_cuda() ? "cuda" : "cpu", /*moe=*/true);
  plan.mesh = meshes.world;
  plan.pp_group = plan.mesh.group("pp");
  if (dims.tp > 1) {
    plan.tp_mesh = meshes.tp;
    plan.loss_parallel = !config.parallelism.disable_loss_parallel;
  }
  const auto& p = config.parallelism;
  if (dims.cp > 1) {
    // Each stage's MLA runs the ring over its cp ranks; the hidden states between stages are this rank's chunks
    // (the trainer cuts the rows before the schedule splits them into microbatches). FSDP over dp_shard x cp.
    plan.cp_mesh = meshes.cp;
    plan.fsdp_mesh = meshes.dp;
  }
  const PipelineSplit split = split_pipeline(model->args(), pipeline_split_options(config, dims));
  plan.num_stages = static_cast<int>(split.num_stages);
  plan.stage_indices = split.schedule.stages_of_rank(plan.pp_group->rank());
  plan.pipeline_schedule = split.schedule;
  FsdpOptions fsdp = fsdp_options(config, meshes.dp, /*pipeline=*/true);
  const std::string experts_description =
      pipeline_moe_setup(plan, fsdp, model->args().moe.num_experts, config, dims, meshes);
  std::string layers;
  for (int s : plan.stage_indices) {
    const auto [begin, end] = split.layers[static_cast<size_t>(s)];
    ds::DeepSeekV3Stage stage(*model, begin, end, s == 0, s == plan.num_stages - 1);
    if (dims.tp > 1) apply_tp(stage, model->args(), plan.tp_mesh, plan.loss_parallel);
    if (dims.cp > 1) apply_cp(stage, plan.cp_mesh, p.context_parallel_rotate_method, p.context_parallel_load_balancer);
    // Under cp x tp each MoE block sums its per-sequence counts over both (as the whole model's path).
    if (dims.cp > 1 && dims.tp > 1) set_moe_sequence_group(stage->blocks(), meshes.cp_tp);
    if (dims.ep > 1) {
      for (auto& block : stage->blocks()) {
        if (block->moe) fsdp::apply_expert_parallel(block->moe->experts.ptr(), meshes.ep);
      }
    }
    for (auto& m : fully_shard_blocks_then_root(block_modules(stage->blocks()), stage.ptr(), fsdp, experts_of_block))
      plan.fsdp_modules.push_back(m);
    layers += (layers.empty() ? "" : ", ") + stage_layers_text(s, begin, end, plan.num_stages);
    plan.stages.push_back(pipeline_stage(stage.ptr(), stage_call(stage), plan, dims));
  }
  finish_pipeline_plan(plan, config, dims, layers,
                       (dims.tp > 1 ? tp_description(plan) : std::string()) + cp_description(config, dims) +
                           experts_description);
  return plan;
}

}  // namespace fsdp_train::deepseek_v3
